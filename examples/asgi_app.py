"""kvtier inside a Starlette app: the tiering manager lives in the app's lifespan.

``POST /generate`` with ``{"prompt": "...", "max_tokens": 4}`` runs the prompt through a tiny
transformer (``demo_engine.py``, bytes as tokens) and answers with the generated token ids and
how many prefix blocks kvtier served instead of recomputing them. ``GET /stats`` shows the
manager's counters; ``GET /metrics`` exports them to Prometheus through
``kvtier.metrics_asgi_app`` (prometheus_client's ASGI app, served by the app's own server; it
needs ``kvtier[metrics]``). Serve it with any ASGI server, for example uvicorn, from the
repository root::

    uvicorn --app-dir examples asgi_app:app --host 127.0.0.1

``python3 -m nox -s asgi`` runs that line in an environment with everything it needs (uvicorn,
starlette, torch, tqdm).

Why the lifespan: the ``TieringManager`` owns background work (promotions, write-through) in a
task group, so it must be entered once when the app starts and left when it stops, on the same
event loop as the requests; one manager is shared by all requests, which is what lets one
user's prompt serve another's prefix.

``python examples/asgi_app.py`` (add ``--json`` for one JSON object) runs a short session
against the app in this process, through httpx's ASGI transport with the lifespan entered as a
server would: two users with the same system prompt, the first prompt again, four concurrent
requests, then ``/stats`` and ``/metrics``; it prints what each answer said.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import demo_engine
import torch
from demo_engine import KVCache, ModelConfig, TinyTransformer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import kvtier

__all__ = ["CONFIG", "app", "create_app"]

T = TypeVar("T")

CONFIG = ModelConfig(vocab_size=256, d_model=128, n_heads=2, n_layers=2, d_mlp=256, block_size=16)
"""Small enough to answer in milliseconds; tokens are the prompt's UTF-8 bytes."""
MAX_PROMPT_BYTES = 16_384
MAX_NEW_TOKENS = 32


@dataclass(slots=True)
class Engine:
    model: TinyTransformer
    manager: kvtier.TieringManager
    scheduler: kvtier.OffloadScheduler
    compute: anyio.CapacityLimiter  # one forward pass at a time, off the event loop

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.compute)


def create_app(*, pool_blocks: int = 256, fs_root: str | None = None) -> Starlette:
    """An app whose kvtier stack is a host pool of ``pool_blocks`` blocks over a file tier
    (in ``fs_root``, or a temporary folder removed at shutdown)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        torch.manual_seed(CONFIG.seed)
        async with AsyncExitStack() as stack:
            root = fs_root or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-"))
            pool = kvtier.HostPool(pool_blocks, CONFIG.block_bytes)
            manager = await stack.enter_async_context(
                kvtier.TieringManager(pool, [kvtier.FSTier(root, fsync="never")])
            )
            scheduler = kvtier.OffloadScheduler(manager)
            app.state.engine = Engine(
                TinyTransformer(CONFIG), manager, scheduler, anyio.CapacityLimiter(1)
            )
            app.state.metrics = kvtier.metrics_asgi_app(manager, scheduler=scheduler)
            yield
            app.state.engine = app.state.metrics = None

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/stats", stats),
            Route("/metrics", Metrics(), methods=["GET"]),
        ],
        lifespan=lifespan,
    )


class Metrics:
    """``/metrics``: the ASGI app the lifespan made with the manager (a class, so Starlette
    routes the request to it as an ASGI app)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await scope["app"].state.metrics(scope, receive, send)


async def generate(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    try:
        body = await request.json()
        prompt = body["prompt"]
        max_tokens = int(body.get("max_tokens", 4))
    except (ValueError, KeyError, TypeError):
        return JSONResponse({"error": 'send JSON {"prompt": "...", "max_tokens": 4}'}, 400)
    data = prompt.encode() if isinstance(prompt, str) else b""
    if not data or len(data) > MAX_PROMPT_BYTES or not 1 <= max_tokens <= MAX_NEW_TOKENS:
        return JSONResponse(
            {
                "error": f"prompt must be 1 to {MAX_PROMPT_BYTES} bytes of text and max_tokens "
                f"1 to {MAX_NEW_TOKENS}"
            },
            400,
        )
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    bs = CONFIG.block_size
    keys = kvtier.block_keys(tokens, bs, namespace=CONFIG.namespace)
    usable = keys[: (len(tokens) - 1) // bs]  # leave at least one token to compute
    hit = await engine.scheduler.lookup(usable, timeout=1.0) if usable else 0
    staging = torch.empty(hit, CONFIG.block_numel)
    served = await engine.manager.load(usable[:hit], staging) if hit else 0
    cache = KVCache(CONFIG, len(tokens) + max_tokens)

    def prefill() -> tuple[int, torch.Tensor | None]:
        cache.scatter_blocks(staging, served)
        logits = engine.model.forward_tokens(tokens[served * bs :], cache)
        new = cache.gather_blocks(served, len(keys)) if len(keys) > served else None
        return int(logits.argmax()), new

    token, new_blocks = await engine.run(prefill)
    stored = await engine.manager.store(keys[served:], new_blocks) if new_blocks is not None else 0
    completion = [token]
    while len(completion) < max_tokens:
        logits = await engine.run(engine.model.forward_tokens, torch.tensor([token]), cache)
        token = int(logits.argmax())
        completion.append(token)
    return JSONResponse(
        {
            "prompt_tokens": len(tokens),
            "prefix_blocks": len(usable),
            "served_blocks": served,
            "computed_tokens": len(tokens) - served * bs,
            "stored_blocks": stored,
            "completion": completion,
        }
    )


async def stats(request: Request) -> JSONResponse:
    s = request.app.state.engine.manager.statistics()
    return JSONResponse(
        {
            "blocks_loaded": s.stores.loaded,
            "blocks_stored": s.stores.stored,
            "promotions": s.promotions.succeeded,
            "pool": {"ready": s.pool.ready, "free": s.pool.free, "evictions": s.pool.evictions},
            "tiers": {t.name: {"blocks": t.blocks, "loads": t.loads} for t in s.tiers},
        }
    )


app = create_app()


# -- a short session against the app, in this process -----------------------------------------


@asynccontextmanager
async def client(app: Starlette) -> AsyncIterator[Any]:
    """An httpx client on ``app`` with its lifespan running, as a server would run it (httpx's
    ASGITransport does not run the lifespan itself)."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c,
    ):
        yield c


async def session(pool_blocks: int = 64) -> dict[str, Any]:
    """Two users with one system prompt, the first prompt again, four at once, a bad request,
    then the counters: every answer, as the app gave it."""
    system = "You are a careful assistant. Answer briefly and cite sources. " * 6
    out: dict[str, Any] = {"settings": {"pool_blocks": pool_blocks, "system_prompt": system}}
    async with client(create_app(pool_blocks=pool_blocks)) as c:

        async def ask(prompt: str, **extra: Any) -> Any:
            return (await c.post("/generate", json={"prompt": system + prompt, **extra})).json()

        out["first"] = await ask("What is KV?")
        out["second_user"] = await ask("Why tiers?", max_tokens=2)
        out["first_again"] = await ask("What is KV?")
        concurrent: list[Any] = []

        async def one(i: int) -> None:
            concurrent.append(await ask(f"Question {i}?"))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        out["concurrent"] = concurrent
        out["stats"] = (await c.get("/stats")).json()
        metrics = await c.get("/metrics")
        out["metrics"] = {"status": metrics.status_code, "text": metrics.text}
        bad = await c.post("/generate", json={"text": "no prompt"})
        out["bad_request"] = {"status": bad.status_code, "body": bad.json()}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A short session against the app, in process.")
    p.add_argument("--pool-blocks", type=int, default=64)
    p.add_argument("--json", action="store_true", help=demo_engine.JSON_HELP)
    args = p.parse_args(argv)
    with demo_engine.json_report(args.json) as out:
        out.update(anyio.run(session, args.pool_blocks))
        for name in ("first", "second_user", "first_again"):
            answer = out[name]
            print(
                f"{name:<12} {answer['prompt_tokens']} tokens, {answer['served_blocks']} of "
                f"{answer['prefix_blocks']} prefix blocks from kvtier, completion "
                f"{answer['completion']}"
            )
        served = [r["served_blocks"] for r in out["concurrent"]]
        print(f"concurrent   blocks from kvtier per request: {served}")
        print(f"/stats       {out['stats']}")
        print(f"/metrics     HTTP {out['metrics']['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
