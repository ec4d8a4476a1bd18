"""The demo's engine: a small causal transformer with a real KV cache, the serving loop that
embeds kvtier the way a real engine does, the chat workload, and the demo's tier setup.

``serve_demo.py``, ``two_nodes.py``, ``asgi_app.py`` and ``benchmarks/bench_demo_tiers.py``
import it (the examples as ``demo_engine``: a script's own folder is on its path; the benchmark
as ``examples.demo_engine``, run with ``python -m`` from the repository root). It imports
nothing but kvtier's public names, torch, numpy, anyio, tqdm and its neighbour
``loop_stalls``.

The model: token embeddings, pre-norm decoder layers with rotary attention and an MLP, and a
per-layer K/V cache filled by prefill and decode. Weights are random (a fixed seed), so the
numbers mean nothing, but the arithmetic is the real thing: a prefill costs O(tokens x params +
tokens^2 x width), while loading the same tokens' KV is a memcpy, which is exactly the trade
kvtier makes.

The block layout is the one kvtier stores: one block is the K and V of ``block_size``
consecutive tokens across *all* layers, packed as ``(layers, 2, block_size, heads, head_dim)``
in one contiguous row, so one key names one self-contained piece of the prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import kvtier

if __package__:  # imported as examples.demo_engine (the benchmarks and tests)
    from .loop_stalls import StallProbe
else:  # a script in examples/ imported it as demo_engine
    from loop_stalls import StallProbe  # type: ignore[import-not-found,no-redef]

T = TypeVar("T")

PACED_S3_MIB_PER_S = 2.0
"""MiB/s of writes the S3 tier gets while serving when a file tier sits above it: on a small
machine the object store runs beside the engine, and writing every block through costs the
engine part of the file tier's speedup (``benchmarks/bench_demo_tiers.py`` measures it)."""

LOOKUP_TIMEOUT = 2.0
"""Longest a request waits for promotions; past it the engine recomputes what is not loaded."""
TOLERANCE = 1e-3
"""Largest |logit difference| accepted between loaded-KV prefill and full recompute."""


# -- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 1024
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_mlp: int = 1024
    max_len: int = 8192
    block_size: int = 32
    prefill_chunk: int = 512
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def block_numel(self) -> int:
        """float32 elements in one block: K and V of block_size tokens in every layer."""
        return self.n_layers * 2 * self.block_size * self.n_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * 4

    @property
    def namespace(self) -> bytes:
        """Everything that changes the KV bytes of the same tokens goes into the key space."""
        return (
            f"tiny-transformer/seed={self.seed}/d={self.d_model}/h={self.n_heads}/"
            f"l={self.n_layers}/v={self.vocab_size}/float32/lk2bhd/bs={self.block_size}"
        ).encode()


class KVCache:
    """One sequence's cache: ``k`` and ``v`` are ``(layers, max_len, heads, head_dim)``."""

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        shape = (config.n_layers, max_len, config.n_heads, config.head_dim)
        self.config = config
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.length = 0

    def scatter_blocks(self, blocks: torch.Tensor, n_blocks: int) -> None:
        """Write ``blocks[:n_blocks]`` (rows of ``block_numel``) to the first positions of the
        cache, the way an engine copies loaded blocks into its per-layer KV tensors."""
        c = self.config
        if n_blocks == 0:
            return
        packed = blocks[:n_blocks].view(
            n_blocks, c.n_layers, 2, c.block_size, c.n_heads, c.head_dim
        )
        tokens = n_blocks * c.block_size
        # (n, L, 2, bs, H, D) -> (L, n * bs, H, D) for K and for V
        self.k[:, :tokens] = (
            packed[:, :, 0].transpose(0, 1).reshape(c.n_layers, tokens, -1, c.head_dim)
        )
        self.v[:, :tokens] = (
            packed[:, :, 1].transpose(0, 1).reshape(c.n_layers, tokens, -1, c.head_dim)
        )
        self.length = tokens

    def gather_blocks(self, first: int, last: int) -> torch.Tensor:
        """Blocks ``first`` .. ``last - 1`` packed as rows of ``block_numel`` (a new tensor)."""
        c = self.config
        n = last - first
        start, stop = first * c.block_size, last * c.block_size
        assert stop <= self.length, "gathering blocks past the filled part of the cache"
        k = self.k[:, start:stop].reshape(c.n_layers, n, c.block_size, c.n_heads, c.head_dim)
        v = self.v[:, start:stop].reshape(c.n_layers, n, c.block_size, c.n_heads, c.head_dim)
        packed = torch.stack((k, v), dim=2).transpose(0, 1)  # (n, L, 2, bs, H, D)
        return packed.reshape(n, c.block_numel).contiguous()


class TinyTransformer(torch.nn.Module):
    """Pre-norm decoder with rotary attention; random weights from ``config.seed``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.prefill_chunk = config.prefill_chunk
        gen = torch.Generator().manual_seed(config.seed)
        d, m = config.d_model, config.d_mlp

        def param(*shape: int, scale: float) -> torch.nn.Parameter:
            return torch.nn.Parameter(
                torch.randn(*shape, generator=gen) * scale, requires_grad=False
            )

        self.embed = param(config.vocab_size, d, scale=1.0)
        self.wqkv = torch.nn.ParameterList(
            [param(d, 3 * d, scale=1 / math.sqrt(d)) for _ in range(config.n_layers)]
        )
        self.wo = torch.nn.ParameterList(
            [param(d, d, scale=1 / math.sqrt(d)) for _ in range(config.n_layers)]
        )
        self.w1 = torch.nn.ParameterList(
            [param(d, m, scale=1 / math.sqrt(d)) for _ in range(config.n_layers)]
        )
        self.w2 = torch.nn.ParameterList(
            [param(m, d, scale=1 / math.sqrt(m)) for _ in range(config.n_layers)]
        )
        self.unembed = param(d, config.vocab_size, scale=1 / math.sqrt(d))
        half = config.head_dim // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(config.max_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate ``x`` of shape (tokens, heads, head_dim) for absolute positions start..."""
        n = x.shape[0]
        cos = self.cos[start : start + n, None, :]  # type: ignore[index]
        sin = self.sin[start : start + n, None, :]  # type: ignore[index]
        x1, x2 = x[..., ::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., ::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    @torch.inference_mode()
    def forward_tokens(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run ``tokens`` (1-D) after the ``cache.length`` cached ones, appending their K/V to
        the cache; return the next-token logits of the last position.

        Long inputs run as a chunked prefill (``prefill_chunk`` tokens at a time), as serving
        engines do, so the attention scores of one chunk stay small.
        """
        if cache.length + tokens.shape[0] > cache.k.shape[1]:
            raise ValueError(
                f"sequence of {cache.length + tokens.shape[0]} tokens does not fit a cache of "
                f"{cache.k.shape[1]}"
            )
        logits = torch.empty(0)
        for first in range(0, tokens.shape[0], self.prefill_chunk):
            logits = self._chunk(tokens[first : first + self.prefill_chunk], cache)
        return logits

    def _chunk(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        c = self.config
        start = cache.length
        n = tokens.shape[0]
        end = start + n
        x = self.embed[tokens]
        # query i (absolute position start + i) may see keys 0 .. start + i
        visible = None if n == 1 else torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
        scale = 1.0 / math.sqrt(c.head_dim)
        for layer in range(c.n_layers):
            h = F.rms_norm(x, (c.d_model,))
            q, k, v = (h @ self.wqkv[layer]).view(n, 3, c.n_heads, c.head_dim).unbind(1)
            q, k = self._rope(q, start), self._rope(k, start)
            cache.k[layer, start:end] = k
            cache.v[layer, start:end] = v
            keys = cache.k[layer, :end].transpose(0, 1)  # (H, end, D)
            values = cache.v[layer, :end].transpose(0, 1)
            # Plain matmul attention: on a small CPU it beats the fused kernel at head_dim 64.
            scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * scale  # (H, n, end)
            if visible is not None:
                scores.masked_fill_(~visible, float("-inf"))
            attn = scores.softmax(dim=-1) @ values  # (H, n, D)
            x = x + attn.transpose(0, 1).reshape(n, c.d_model) @ self.wo[layer]
            h = F.rms_norm(x, (c.d_model,))
            x = x + F.gelu(h @ self.w1[layer]) @ self.w2[layer]
        cache.length = end
        last = F.rms_norm(x[-1], (c.d_model,))
        return last @ self.unembed


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    session: int
    turn: int
    tokens: torch.Tensor  # int64, 1-D: the whole prompt


def make_sessions(
    *,
    sessions: int,
    requests: int,
    system_prompts: int,
    system_tokens: int,
    turn_tokens: tuple[int, int],
    vocab: int,
    seed: int,
) -> list[list[Request]]:
    """Multi-turn chats: each prompt is its session's previous prompt plus the (scripted)
    assistant reply plus a new user message; sessions share ``system_prompts`` prefixes."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, system_tokens) for _ in range(system_prompts)]
    out: list[list[Request]] = []
    rid = 0
    for s in range(sessions):
        turns = requests // sessions + (1 if s < requests % sessions else 0)
        history = systems[s % system_prompts]
        chat: list[Request] = []
        for t in range(turns):
            if t:  # the assistant's reply to the previous turn
                history = np.concatenate(
                    [history, rng.integers(0, vocab, rng.integers(*turn_tokens))]
                )
            history = np.concatenate([history, rng.integers(0, vocab, rng.integers(*turn_tokens))])
            chat.append(Request(rid, s, t, torch.from_numpy(history.astype(np.int64))))
            rid += 1
        out.append(chat)
    return out


# -- the engine --------------------------------------------------------------------------------


@dataclass(slots=True)
class Slot:
    """What one in-flight request owns: its KV cache and a staging buffer for loaded blocks,
    both allocated once, as an engine preallocates its KV memory."""

    cache: KVCache
    staging: torch.Tensor  # (max_blocks, block_numel) float32


@dataclass(slots=True)
class RequestResult:
    rid: int
    ttft: float
    prompt_tokens: int
    loaded_blocks: int = 0
    resident_blocks: int = 0
    lookup_seconds: float = 0.0  # waiting in the scheduler's lookup, once scheduled
    stored_blocks: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    logits: torch.Tensor | None = None


@dataclass(slots=True)
class RunResult:
    label: str
    wall: float
    results: dict[int, RequestResult] = field(default_factory=dict)
    loop_lag: list[float] = field(default_factory=list)  # seconds late, per 5 ms timer
    stalls: dict[str, Any] | None = None  # the stall probe's summary, when one ran

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.results.values()]


class Engine:
    """The model behind one worker thread: forward passes run one at a time, off the loop."""

    def __init__(self, model: TinyTransformer, slots: int, max_len: int) -> None:
        c = model.config
        self.model = model
        self.config = c
        self._compute = anyio.CapacityLimiter(1)
        self._slots = FirstComeFirstServed[Slot]()
        for _ in range(slots):
            self._slots.put_nowait(
                Slot(KVCache(c, max_len), torch.empty(max_len // c.block_size, c.block_numel))
            )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._compute)

    async def acquire(self) -> Slot:
        return await self._slots.get()

    def release(self, slot: Slot) -> None:
        slot.cache.length = 0
        self._slots.put_nowait(slot)


class FirstComeFirstServed(Generic[T]):
    """The engine's free slots, handed to waiting requests in the order they arrived.

    Not an ``asyncio.Queue``: its ``get()`` lets a task that asks just as a slot is freed take
    it ahead of the tasks already waiting (a woken waiter looks again only when it runs). Here
    that task is the same session's next turn, so it jumped ahead of every queued request;
    the queued requests (in two_nodes, the moved sessions' first turns) waited seconds longer
    than a first-come-first-served engine would make them wait.
    """

    def __init__(self) -> None:
        self._free: list[T] = []
        self._waiters: collections.deque[asyncio.Future[T]] = collections.deque()

    async def get(self) -> T:
        if self._free and not self._waiters:
            return self._free.pop()
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.put_nowait(waiter.result())  # handed to us as we were cancelled: pass on
            raise

    def put_nowait(self, item: T) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled waiter is skipped
                waiter.set_result(item)
                return
        self._free.append(item)


@dataclass(slots=True)
class KVTier:
    """The kvtier objects a serving loop holds."""

    manager: kvtier.TieringManager
    scheduler: kvtier.OffloadScheduler
    report_recompute: bool = True  # tell kvtier what each prefill cost
    prefetch: bool = True  # fetch a queued request's prefix while it waits for a slot


async def serve(
    engine: Engine, request: Request, tiering: KVTier | None, decode_tokens: int
) -> RequestResult:
    """One request, start to finish; see the module docstring for the steps."""
    c = engine.config
    bs = c.block_size
    arrived = time.perf_counter()
    tokens = request.tokens
    n = tokens.shape[0]
    keys: list[bytes] = []
    usable: list[bytes] = []
    prefetch: kvtier.PrefetchHandle | None = None
    if tiering is not None:
        keys = kvtier.block_keys(tokens, bs, namespace=c.namespace)
        # Only blocks that end before the last prompt token can be loaded: the engine must
        # run at least one token to get the next-token logits.
        usable = keys[: (n - 1) // bs]
        if tiering.prefetch and usable:
            # The request joins the queue: fetch its prefix while it waits for a slot; its
            # lookup below claims what the prefetch fetched.
            prefetch = tiering.scheduler.prefetch(usable)
    try:
        slot = await engine.acquire()
    except BaseException:
        if prefetch is not None:
            prefetch.cancel()  # aborted while queued: give back what it holds
        raise
    try:
        result = RequestResult(request.rid, 0.0, n)
        loaded = 0
        if tiering is not None:
            pool = tiering.manager.pool
            resident = 0
            for key in usable:
                if pool.state_of(key) is not kvtier.SlotState.READY:
                    break
                resident += 1
            # Blocks this request's own prefetch promoted are counted where they came from (a
            # tier), not as already resident: the breakdown then adds up to the blocks served.
            if prefetch is not None:
                resident = max(resident - prefetch.fetched(), 0)
            started = time.perf_counter()
            hit = await tiering.scheduler.lookup(usable, timeout=LOOKUP_TIMEOUT) if usable else 0
            result.lookup_seconds = time.perf_counter() - started
            if hit:
                started = time.perf_counter()
                loaded = await tiering.manager.load(usable[:hit], slot.staging[:hit])
                result.load_seconds = time.perf_counter() - started
            result.loaded_blocks = loaded
            result.resident_blocks = min(resident, loaded)

        def prefill() -> tuple[torch.Tensor, torch.Tensor | None, float]:
            started = time.perf_counter()
            slot.cache.scatter_blocks(slot.staging, loaded)
            logits = engine.model.forward_tokens(tokens[loaded * bs :], slot.cache)
            seconds = time.perf_counter() - started
            new = slot.cache.gather_blocks(loaded, len(keys)) if len(keys) > loaded else None
            return logits, new, seconds

        logits, new_blocks, prefill_seconds = await engine.run(prefill)
        if tiering is not None and tiering.report_recompute:
            # The recompute cost kvtier weighs waiting against: this prefill, per block.
            tiering.manager.cost.observe_recompute(max((n - loaded * bs) // bs, 1), prefill_seconds)
        token = int(logits.argmax())
        result.ttft = time.perf_counter() - arrived
        result.logits = logits
        if tiering is not None and new_blocks is not None:
            started = time.perf_counter()
            result.stored_blocks = await tiering.manager.store(keys[loaded:], new_blocks)
            result.store_seconds = time.perf_counter() - started
        for _ in range(decode_tokens - 1):
            step = await engine.run(engine.model.forward_tokens, torch.tensor([token]), slot.cache)
            token = int(step.argmax())
        return result
    finally:
        if prefetch is not None and not prefetch.done:
            prefetch.cancel()  # the request failed before its lookup claimed it
        engine.release(slot)


class Progress:
    """A live progress bar on stderr (tqdm) with the run's TTFT p50 and the blocks loaded; when
    stderr is not a terminal it writes a line every few seconds and the last one."""

    def __init__(self, label: str, total: int, block_size: int) -> None:
        self.block_size = block_size
        self.bar = tqdm(
            total=total,
            desc=f"{label:>14}",
            bar_format="{desc}  {n_fmt:>4}/{total_fmt} requests |{bar:20}| [{elapsed}{postfix}]",
            file=sys.stderr,
            mininterval=0.1 if sys.stderr.isatty() else 5.0,
            ascii=not sys.stderr.isatty(),
        )

    def update(self, run: RunResult) -> None:
        ttfts = run.ttfts()
        blocks = sum((r.prompt_tokens - 1) // self.block_size for r in run.results.values())
        loaded = sum(r.loaded_blocks for r in run.results.values())
        p50 = percentile(ttfts, 50)
        self.bar.set_postfix_str(f"TTFT p50 {p50:6.3f} s  loaded {loaded}/{blocks} blocks")
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


async def run_workload(
    label: str,
    engine: Engine,
    sessions: Sequence[Sequence[Request]],
    tiering: KVTier | None,
    decode_tokens: int,
    *,
    stalls: bool = False,
) -> RunResult:
    """Serve ``sessions`` (each sends its next turn when the previous one answered) while a
    5 ms timer measures the loop's lag; with ``stalls``, a ``StallProbe`` also records what the
    loop ran whenever it was late by more than 20 ms."""
    run = RunResult(label, 0.0)
    progress = Progress(label, sum(len(s) for s in sessions), engine.config.block_size)
    started = time.perf_counter()

    async def chat(turns: Sequence[Request]) -> None:
        for request in turns:  # a session sends its next turn when the previous one answered
            result = await serve(engine, request, tiering, decode_tokens)
            run.results[request.rid] = result
            progress.update(run)

    async def lag(done: asyncio.Event) -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            run.loop_lag.append(time.perf_counter() - before - 0.005)

    done = asyncio.Event()
    probe = StallProbe() if stalls else None
    try:
        async with contextlib.AsyncExitStack() as stack:
            if probe is not None:
                await stack.enter_async_context(probe)
            async with asyncio.TaskGroup() as outer:
                outer.create_task(lag(done))
                async with asyncio.TaskGroup() as tg:
                    for turns in sessions:
                        tg.create_task(chat(turns))
                done.set()
    finally:
        progress.close()
    if probe is not None:
        run.stalls = probe.summary()
    run.wall = time.perf_counter() - started
    return run


# -- tiers -------------------------------------------------------------------------------------


def make_tiers(args: argparse.Namespace, scratch: str) -> list[kvtier.SecondaryTier]:
    """The secondary tiers, fastest first: a file tier (in ``scratch`` unless ``--fs-root``),
    then S3 when a bucket is given."""
    tiers: list[kvtier.SecondaryTier] = []
    if args.fs_capacity_mb > 0:
        root = args.fs_root or os.path.join(scratch, "fs")
        tiers.append(
            kvtier.FSTier(root, capacity_bytes=args.fs_capacity_mb << 20, fsync=args.fsync)
        )
    if args.s3_endpoint or args.s3_bucket:
        tiers.append(  # credentials from the environment, as for any aiobotocore client
            kvtier.S3Tier(args.s3_bucket, prefix=args.s3_prefix, endpoint_url=args.s3_endpoint)
        )
    if args.slow_tier is not None:  # last: a tier slower than recomputing (a demo of the rule)
        tiers.append(DelayedTier(kvtier.MemoryTier("slow.inner"), args.slow_tier, name="slow"))
    return tiers


class DelayedTier(kvtier.SecondaryTier):
    """A store ``delay`` seconds away, like an object store across a slow network: every
    existence check, load, store and delete waits that long, then ``inner`` serves it.

    It keeps no index of its own, so a lookup it cannot answer yet says ``RETRY`` and asks the
    store in the background (kvtier's ``AsyncLookupManager``), as a remote tier without a
    listing does. The demo's ``--slow-tier`` puts one under the others to show that kvtier
    neither waits for nor promotes from a tier slower than recomputing the prefix.
    """

    def __init__(self, inner: kvtier.SecondaryTier, delay: float, *, name: str) -> None:
        super().__init__(name)
        self.inner = inner
        self.delay = delay
        self._verdicts = kvtier.AsyncLookupManager(
            self.contains_many, name=name, timeout=5.0, on_verdict=self.notify
        )

    async def aclose(self) -> None:
        await self._verdicts.aclose()
        await self.inner.aclose()

    async def open(self) -> None:
        """Open the store, then start answering lookups (a reopened tier asks afresh)."""
        await self.inner.open()
        if self._verdicts.is_open:
            return
        await self._verdicts.__aenter__()

    def lookup(self, key: bytes) -> kvtier.LookupResult:
        return self._verdicts.lookup(key)

    def lookup_with_reason(
        self, key: bytes
    ) -> tuple[kvtier.LookupResult, kvtier.MissReason | None]:
        return self._verdicts.lookup_with_reason(key)

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        await anyio.sleep(self.delay)
        return await self.inner.contains_many(keys)

    async def load(self, key: bytes, dst: memoryview) -> None:
        await anyio.sleep(self.delay)
        await self.inner.load(key, dst)

    async def store(self, key: bytes, src: memoryview) -> None:
        await anyio.sleep(self.delay)
        await self.inner.store(key, src)
        self._verdicts.record(key, True)

    async def delete(self, key: bytes) -> None:
        await anyio.sleep(self.delay)
        await self.inner.delete(key)
        self._verdicts.forget(key)

    def statistics(self) -> kvtier.TierStatistics:
        """The inner store's counters, under this tier's name and with its lookups."""
        inner = self.inner.statistics()
        return dataclasses.replace(inner, name=self.name, lookups=self._verdicts.statistics())


def make_manager(
    args: argparse.Namespace,
    pool: kvtier.HostPool,
    tiers: Sequence[kvtier.SecondaryTier],
    latency: kvtier.LatencyHistograms,
) -> kvtier.TieringManager:
    """The manager over ``pool`` and ``tiers``, with the admission the flags ask for."""
    options: dict[str, Any] = {"promote_write_up": not args.no_promote_write_up}
    manager = kvtier.TieringManager(pool, tiers, latency=latency, **options)
    if not (args.write_back or args.defer or args.s3_write_rate):
        return manager
    rate = None if args.s3_write_rate is None else {"s3": args.s3_write_rate * 2**20}
    admission = kvtier.AdmissionPolicy(  # the default admission, plus what the flags add
        max_in_flight_bytes=manager.default_tier_in_flight_bytes(),
        write_back=args.write_back,
        deferred=args.defer,
        max_write_rate=rate,
    )
    return kvtier.TieringManager(pool, tiers, latency=latency, admission=admission, **options)


# -- the demo's options and start -------------------------------------------------------------


def parse_args(
    argv: Sequence[str] | None = None, description: str | None = None
) -> argparse.Namespace:
    """The demo's options (``serve_demo.py --help``), with the quick mode's defaults filled
    in; ``bench_demo_tiers.py`` builds each of its setups from them too."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--quick", action="store_true", help="a small workload (seconds), for tests and CI"
    )
    p.add_argument(
        "--workload",
        choices=["chat", "agent"],
        default="chat",
        help="chat sessions (the default), or agent sessions with tool-call gaps between "
        "turns, run without kvtier, without and with session hints, and at the ceiling "
        "(serve_demo.py only; see examples/agent_demo.py)",
    )
    p.add_argument(
        "--predict-returns",
        action="store_true",
        help="--workload agent: do not tell kvtier when a tool call returns (it predicts it)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="--workload agent: make the four runs this many times and report each figure "
        "over the turns of all of them",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the long run (the default; `nox -s demo` is quick unless given --full)",
    )
    p.add_argument("--requests", type=int, help="requests in all (default 48, quick 16)")
    p.add_argument("--sessions", type=int, help="concurrent chat sessions (default 8, quick 4)")
    p.add_argument(
        "--concurrency", type=int, help="requests the engine admits at once (default 4, quick 2)"
    )
    p.add_argument(
        "--pool-blocks", type=int, help="host pool size in blocks (default 160, quick 48)"
    )
    p.add_argument(
        "--policy", choices=["lru", "arc"], default="lru", help="host pool eviction policy"
    )
    p.add_argument(
        "--fs-capacity-mb", type=int, default=1024, help="file tier size; 0: no file tier"
    )
    p.add_argument("--fs-root", help="file tier folder (default: a temporary folder)")
    p.add_argument("--fsync", choices=["never", "data", "always"], default="data")
    p.add_argument(
        "--s3-endpoint",
        help="add an S3 tier at this endpoint URL (SeaweedFS, MinIO, Ceph; credentials from the "
        "environment); `nox -s demo -- --s3` starts a SeaweedFS and passes it",
    )
    p.add_argument(
        "--s3-bucket", help="the S3 tier's bucket (default kvtier-demo with --s3-endpoint)"
    )
    p.add_argument("--s3-prefix", default="kvtier-serve-demo/")
    p.add_argument("--no-kvtier", action="store_true", help="run only the workload without kvtier")
    p.add_argument(
        "--no-prefetch",
        action="store_true",
        help="do not prefetch a queued request's prefix (OffloadScheduler.prefetch) while it "
        "waits for a slot",
    )
    p.add_argument(
        "--system-tokens", type=int, help="tokens per system prompt (default 768, quick 384)"
    )
    p.add_argument("--decode-tokens", type=int, default=4, help="tokens decoded per request")
    p.add_argument("--seed", type=int, default=0)
    policy = p.add_argument_group("never slower than recompute")
    policy.add_argument(
        "--slow-tier",
        type=float,
        metavar="SECONDS",
        help="add a tier that takes SECONDS per operation (a DelayedTier over memory)",
    )
    policy.add_argument(
        "--no-recompute-cost",
        action="store_true",
        help="do not tell kvtier what prefill costs (it then waits up to the lookup timeout)",
    )
    policy.add_argument(
        "--write-back",
        action="append",
        default=[],
        metavar="TIER",
        help="write this tier (fs, s3, slow) only when a block leaves the pool",
    )
    policy.add_argument(
        "--defer",
        action="append",
        default=[],
        metavar="TIER",
        help="keep the writes to this tier (s3) that back-pressure drops, and write them later "
        "from a faster tier",
    )
    policy.add_argument(
        "--s3-write-rate",
        type=float,
        metavar="MIB_PER_S",
        help="give the S3 tier at most this many MiB/s of writes while serving (add --defer "
        "s3 to write the rest later, at the latest when the demo closes kvtier); below a file "
        f"tier the default is {PACED_S3_MIB_PER_S:g}, deferred (see --s3-write-through)",
    )
    policy.add_argument(
        "--s3-write-through",
        action="store_true",
        help="write every block through to S3 as it is stored, even below a file tier",
    )
    policy.add_argument(
        "--no-promote-write-up",
        action="store_true",
        help="do not copy blocks promoted from a slower tier (S3) to the faster ones (fs)",
    )
    p.add_argument(
        "--stalls",
        action="store_true",
        help="sample the loop thread's stack whenever the loop is late by more than 20 ms and "
        "report what ran (examples/loop_stalls.py; the probe's own thread adds a little lag)",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics while it runs (kvtier[metrics])",
    )
    args = p.parse_args(argv)
    quick = args.quick
    agent = args.workload == "agent"
    defaults = {
        "requests": (20 if quick else 48) if agent else (16 if quick else 48),
        "sessions": 4 if quick else 8,
        "concurrency": 2 if quick else 4,
        "pool_blocks": 0 if agent else (48 if quick else 160),  # agent: from the workload
        "system_tokens": 384 if quick else 768,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.turn_tokens = (32, 128) if quick else (64, 256)
    args.answer_tokens = (16, 64) if quick else (32, 128)
    args.gap_seconds = (0.1, 1.0) if quick else (0.2, 3.0)  # an agent's tool calls
    positive = ("requests", "sessions", "concurrency", "decode_tokens", "repeat")
    for name in (*positive, *(() if agent and args.pool_blocks == 0 else ("pool_blocks",))):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.s3_endpoint and not args.s3_bucket:
        args.s3_bucket = "kvtier-demo"
    if args.s3_write_rate is not None and not args.s3_write_rate > 0:
        p.error("--s3-write-rate must be a positive number of MiB/s")
    if args.s3_write_through and args.s3_write_rate is not None:
        p.error("--s3-write-through and --s3-write-rate contradict each other: choose one")
    paced = args.s3_bucket and args.fs_capacity_mb > 0 and args.s3_write_rate is None
    if paced and not args.s3_write_through:
        # Below a file tier, S3's copy of a block can wait: pace the writes and defer the
        # rest (written from the file tier, every one by the time kvtier closes).
        args.s3_write_rate = PACED_S3_MIB_PER_S
        args.defer = [*dict.fromkeys([*args.defer, "s3"])]
    if args.fs_capacity_mb < 0:
        p.error("--fs-capacity-mb must be 0 (no file tier) or positive")
    return args


def chat_workload(
    args: argparse.Namespace, config: ModelConfig, requests: int
) -> tuple[list[list[Request]], int, int]:
    """The chat sessions ``args`` ask for (``requests`` turns in all), the longest prompt, and
    the KV length an engine needs for it and its decode (whole blocks); exits when the model
    cannot take that long a sequence."""
    sessions = make_sessions(
        sessions=args.sessions,
        requests=requests,
        system_prompts=min(3, args.sessions),
        system_tokens=args.system_tokens,
        turn_tokens=args.turn_tokens,
        vocab=config.vocab_size,
        seed=args.seed,
    )
    longest = max(r.tokens.shape[0] for chat in sessions for r in chat)
    max_len = math.ceil((longest + args.decode_tokens) / config.block_size) * config.block_size
    if max_len > config.max_len:
        raise SystemExit(f"prompts reach {longest} tokens; the model takes {config.max_len}")
    return sessions, longest, max_len


async def start_engine(args: argparse.Namespace) -> tuple[Engine, list[list[Request]]]:
    """The model, the workload's chat sessions and a warmed-up engine, as ``args`` say."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    config = ModelConfig(seed=args.seed)
    model = TinyTransformer(config)
    sessions, longest, max_len = chat_workload(args, config, args.requests)
    engine = Engine(model, args.concurrency, max_len)
    print(
        f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, "
        f"block {config.block_size} tokens = {config.block_bytes // 1024} KiB; "
        f"{args.requests} requests in {args.sessions} sessions, prompts up to {longest} tokens, "
        f"concurrency {args.concurrency}",
        flush=True,
    )
    await engine.run(
        model.forward_tokens, sessions[0][0].tokens[:512], KVCache(config, 512)
    )  # warm-up
    return engine, sessions


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (NaN when there are none)."""
    return float(np.percentile(values, q)) if values else float("nan")


# -- output ------------------------------------------------------------------------------------

JSON_HELP = "print one JSON object on stdout (the figures, settings and checks), nothing else"


@contextlib.contextmanager
def json_report(enabled: bool) -> Iterator[dict[str, Any]]:
    """With ``enabled``: what the body prints goes to stderr, and the dict it fills is printed
    on stdout as one JSON object when it ends. Without: the body prints as it does, and the
    dict is dropped. The scripts fill the dict either way, so both modes measure the same."""
    figures: dict[str, Any] = {}
    if not enabled:
        yield figures
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield figures
    print(json.dumps(finite(figures), allow_nan=False))


def logits_check(diffs: Sequence[float]) -> dict[str, Any]:
    """The correctness check over the largest |logit difference| of each compared request:
    passed when none is above ``TOLERANCE`` (and trivially when none was compared)."""
    worst = max(diffs, default=0.0)
    return {
        "ok": worst <= TOLERANCE,
        "compared": len(diffs),
        "max_abs_diff": worst,
        "tolerance": TOLERANCE,
    }


def settings(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options ``names`` of ``args``: what a run was asked for, as its JSON states it."""
    return {name: getattr(args, name) for name in names}


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite (a percentile of nothing) as None, so
    the JSON is standard JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


if __name__ == "__main__":
    # A module the demos import, not a script: show its options and where to run them.
    parse_args(
        [*sys.argv[1:]] or ["--help"],
        description="The engine of the demos: run examples/serve_demo.py (or "
        "examples/two_nodes.py, benchmarks/bench_demo_tiers.py) with these options.",
    )
    print("demo_engine.py is imported by the demos: run python examples/serve_demo.py")
