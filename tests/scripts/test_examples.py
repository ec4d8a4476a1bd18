"""The examples run: serve_demo's quick mode end to end, and the ASGI app in-process."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("torch", reason="the examples need torch (the kvtier[torch] extra)")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvtier_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


async def test_the_demo_engine_hands_out_slots_first_come_first_served() -> None:
    slots = _load("serve_demo").FirstComeFirstServed()
    order: list[tuple[str, str]] = []

    async def request(name: str) -> None:
        order.append((name, await slots.get()))

    async def finish_and_send_the_next_turn() -> None:
        # A request frees its slot and the same session asks again at once, with no await in
        # between: it must queue behind the requests already waiting, not take the slot.
        slots.put_nowait("a")
        await request("next turn")

    gave_up = anyio.CancelScope()

    async def give_up() -> None:
        with gave_up:
            await request("gave up")

    async with anyio.create_task_group() as tg:
        for name in ("first", "second"):
            tg.start_soon(request, name)
            await anyio.wait_all_tasks_blocked()
        tg.start_soon(give_up)
        await anyio.wait_all_tasks_blocked()
        gave_up.cancel()  # a waiter that gave up is skipped
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(finish_and_send_the_next_turn)
        await anyio.wait_all_tasks_blocked()
        for slot in "bc":
            slots.put_nowait(slot)
    assert order == [("first", "a"), ("second", "b"), ("next turn", "c")]


@pytest.mark.timeout(300)
def test_serve_demo_quick(tmp_path: Path) -> None:
    fs_root = tmp_path / "fs"
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "serve_demo.py"),
            "--quick",
            "--fs-root",
            str(fs_root),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^metrics: http://127\.0\.0\.1:\d+/metrics$", out, re.M), out
    rows = {}
    for label in ("without kvtier", "with kvtier"):
        m = re.search(rf"^{label}\s+(\d+)\s+([\d.]+) s\s+([\d.]+) s\s+([\d,]+)", out, re.M)
        assert m, out
        rows[label] = (int(m[1]), float(m[2]), float(m[3]), int(m[4].replace(",", "")))
    # the same requests ran both ways, and kvtier prefilled fewer tokens
    assert rows["with kvtier"][0] == rows["without kvtier"][0] > 0
    assert 0 < rows["with kvtier"][3] < rows["without kvtier"][3]
    served = re.search(r"^blocks served\s+([\d,]+) of ([\d,]+)", out, re.M)
    assert served
    assert 0 < int(served[1].replace(",", "")) <= int(served[2].replace(",", ""))
    assert re.search(r"^\s+fs\s+[\d,]+ promoted", out, re.M), out
    check = re.search(
        r"^correctness\s+OK: .* max abs diff ([\d.e+-]+) over (\d+) requests", out, re.M
    )
    assert check, out
    assert float(check[1]) < 1e-3
    assert int(check[2]) > 0
    # the demo wrote its blocks through to the file tier it was given
    assert any(p.is_file() for p in fs_root.rglob("*") if len(p.name) == 32)
    assert "requests" in proc.stderr  # the progress line


@pytest.mark.timeout(300)
def test_serve_demo_with_an_s3_tier(run_script: Callable[..., Any]) -> None:
    """The demo's S3 mode on a real SeaweedFS it starts itself (``--s3-local``): blocks are
    written to S3 (paced below the file tier, the rest deferred and each one accounted for),
    and no S3 request is made on the request path for keys the tier's index does not hold."""
    pytest.importorskip("aiobotocore", reason="the S3 tier needs the kvtier[s3] extra")
    proc = run_script(EXAMPLES / "serve_demo.py", "--quick", "--s3-local")
    assert re.search(r"^s3: SeaweedFS on http://127\.0\.0\.1:\d+", proc.stdout, re.M)
    assert re.search(r"^tiers\s+host pool, fs, s3$", proc.stdout, re.M), proc.stdout
    written = re.search(r"^\s+s3\s+read [\d.]+ MiB.*written ([\d.]+) MiB", proc.stdout, re.M)
    assert written, proc.stdout
    assert float(written[1]) > 0
    unindexed = re.search(r"^\s+s3\s+([\d,]+) requests on the request path", proc.stdout, re.M)
    assert unindexed and unindexed[1] == "0", proc.stdout
    assert re.search(r"^correctness\s+OK", proc.stdout, re.M), proc.stdout
    deferred = re.search(
        r"^deferred\s+([\d,]+) writes .* kept: ([\d,]+) written .* closed, ([\d,]+) given up",
        proc.stdout,
        re.M,
    )
    assert deferred, proc.stdout  # S3 gets 2 MiB/s while serving: more than that is deferred
    kept, written, given_up = (int(g.replace(",", "")) for g in deferred.groups())
    assert kept > 0 and kept == written + given_up, proc.stdout  # each one accounted for


@pytest.mark.timeout(300)
def test_two_nodes_share_blocks_through_one_bucket(run_script: Callable[..., Any]) -> None:
    """Node B loads, from the bucket node A filled, blocks of the chats A computed; asks S3
    nothing on its request path for keys its index does not hold; and its logits with those
    blocks match its own recompute."""
    pytest.importorskip("aiobotocore", reason="the S3 tier needs the kvtier[s3] extra")
    proc = run_script(EXAMPLES / "two_nodes.py", "--quick", "--ceiling")
    written = re.search(r"^node A\s+\d+ requests, wrote ([\d,]+) blocks to S3", proc.stdout, re.M)
    assert written and int(written[1].replace(",", "")) > 0, proc.stdout
    with_s3 = re.search(
        r"^\s+with the shared tier\s+\S+ s\s+\S+ s\s+[\d,]+\s+([\d,]+)$", proc.stdout, re.M
    )
    assert with_s3 and int(with_s3[1].replace(",", "")) > 0, proc.stdout
    # The headline: TTFT of the first turn after the move, both ways, from the same run.
    assert re.search(
        r"^node B, first turn after the move \(4\)\s+TTFT p50\s+TTFT p95\n"
        r"\s+without the shared tier\s+\S+ s\s+\S+ s\n"
        r"\s+with the shared tier\s+\S+ s\s+\S+ s\n"
        r"\s+speedup\s+\S+ x\s+\S+ x$",
        proc.stdout,
        re.M,
    ), proc.stdout
    listed = re.search(
        r"node B's S3 index held ([\d,]+) keys before its first request", proc.stdout
    )
    assert listed and int(listed[1].replace(",", "")) > 0, proc.stdout
    unindexed = re.search(r"request path for keys its index did not hold: (\d+)", proc.stdout)
    assert unindexed and unindexed[1] == "0", proc.stdout
    assert re.search(r"^correctness OK", proc.stdout, re.M), proc.stdout
    # The CPU B and the object store spent while B served, both ways and at the ceiling.
    served = re.search(
        r"^CPU while node B served: without the shared tier ([\d.]+) s; with it ([\d.]+) s in "
        r"node B \+ ([\d.]+) s in SeaweedFS",
        proc.stdout,
        re.M,
    )
    assert served and float(served[1]) > 0 and float(served[2]) > 0, proc.stdout
    assert re.search(
        r"^  CPU while node B served: [\d.]+ s with A's blocks in its memory; with S3 "
        r"[\d.]+ s \+ [\d.]+ s in SeaweedFS: -?[\d.]+ s more, -?[\d.]+ ms per MiB",
        proc.stdout,
        re.M,
    ), proc.stdout
    # A's blocks reached S3 in packs, and B read them with fewer GETs than blocks.
    packed = re.search(r"wrote [\d,]+ blocks to S3, ([\d,]+) of them in packs", proc.stdout)
    assert packed and int(packed[1].replace(",", "")) > 0, proc.stdout
    reads = re.search(
        r"node B read ([\d,]+) .* out of packs, with ([\d,]+) ranged GETs", proc.stdout
    )
    assert reads and 0 < int(reads[2].replace(",", "")) < int(reads[1].replace(",", "")), (
        proc.stdout
    )
    assert re.search(r"^ceiling: .* TTFT p50 \S+ s, \S+ x p50", proc.stdout, re.M), proc.stdout


@asynccontextmanager
async def asgi_client(**options: object) -> AsyncIterator[httpx.AsyncClient]:
    """The example app behind an in-process client, with its lifespan running.

    httpx's ASGITransport does not run the lifespan, so this enters it, as a server would. It
    is a context manager used inside the test, not a fixture, because the manager's task group
    must be entered and left in the same task.
    """
    app = _load("asgi_app").create_app(**options)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c,
    ):
        yield c


async def test_asgi_app_serves_shared_prefixes() -> None:
    async with asgi_client(pool_blocks=64) as client:
        await _exercise(client)


async def _exercise(client: httpx.AsyncClient) -> None:
    system = "You are a careful assistant. Answer briefly and cite sources. " * 6
    first = (await client.post("/generate", json={"prompt": system + "What is KV?"})).json()
    assert first["served_blocks"] == 0
    assert first["stored_blocks"] == first["prompt_tokens"] // 16 > 0
    assert len(first["completion"]) == 4

    # A second user with the same system prompt: its full blocks come from kvtier.
    second = (
        await client.post("/generate", json={"prompt": system + "Why tiers?", "max_tokens": 2})
    ).json()
    shared_blocks = len(system.encode()) // 16
    assert second["served_blocks"] >= shared_blocks - 1
    assert second["computed_tokens"] == second["prompt_tokens"] - 16 * second["served_blocks"]
    assert len(second["completion"]) == 2

    # The same prompt twice gives the same completion, with or without loaded KV.
    again = (await client.post("/generate", json={"prompt": system + "What is KV?"})).json()
    assert again["served_blocks"] == again["prefix_blocks"] > 0
    assert again["completion"] == first["completion"]

    # Concurrent requests share one manager.
    results: list[dict[str, object]] = []

    async def ask(i: int) -> None:
        r = await client.post("/generate", json={"prompt": system + f"Question {i}?"})
        results.append(r.json())

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(ask, i)
    assert len(results) == 4
    assert all(r["served_blocks"] for r in results)

    stats = (await client.get("/stats")).json()
    assert stats["blocks_loaded"] > 0
    assert stats["tiers"]["fs"]["blocks"] > 0

    metrics = await client.get("/metrics")  # prometheus_client's ASGI app, mounted
    assert metrics.status_code == 200
    assert 'kvtier_tier_blocks{tier="fs"}' in metrics.text

    bad = await client.post("/generate", json={"text": "no prompt"})
    assert bad.status_code == 400
