"""kvtier inside a Starlette app: the tiering manager lives in the app's lifespan.

``POST /generate`` with ``{"prompt": "...", "max_tokens": 4}`` runs the prompt through a tiny
transformer (``_tiny_model.py``, bytes as tokens) and answers with the generated token ids and
how many prefix blocks kvtier served instead of recomputing them. ``GET /stats`` shows the
manager's counters; ``GET /metrics`` exports them to Prometheus through
``kvtier.metrics_asgi_app`` (prometheus_client's ASGI app, served by the app's own server; it
needs ``kvtier[metrics]``). Serve it with any ASGI server, for example::

    uvicorn --app-dir examples asgi_app:app --host 127.0.0.1

Why the lifespan: the ``TieringManager`` owns background work (promotions, write-through) in a
task group, so it must be entered once when the app starts and left when it stops, on the same
event loop as the requests; one manager is shared by all requests, which is what lets one
user's prompt serve another's prefix.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import kvtier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tiny_model import KVCache, ModelConfig, TinyTransformer

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
            "blocks_loaded": s.blocks_loaded,
            "blocks_stored": s.blocks_stored,
            "promotions": s.promotions_succeeded,
            "pool": {"ready": s.pool.ready, "free": s.pool.free, "evictions": s.pool.evictions},
            "tiers": {t.name: {"blocks": t.blocks, "loads": t.loads} for t in s.tiers},
        }
    )


app = create_app()
