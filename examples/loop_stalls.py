"""Find what stalls an asyncio event loop: a watchdog thread that samples the loop thread's
stack while the loop is late.

A timer-lag figure says that the loop was late, not why. ``StallProbe`` keeps a heartbeat on
the loop (a callback every ``beat`` seconds) and a thread that, whenever the heartbeat is older
than ``threshold``, takes the loop thread's current Python stack. A stall that lasts several
samples is attributed to the frames seen most often; the collector's passes are timed through
``gc.callbacks`` and attributed to the stalls they overlap, since a collection shows no Python
frame of its own.

The sampler needs the interpreter lock to read a stack, so a stall spent in C code that holds
the lock (a long hash or copy on the loop) is seen by the frame that called it, once the lock
is released: the culprit's caller, which is what one wants to move off the loop anyway.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import linecache
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, Self

__all__ = ["Stall", "StallProbe"]

_OWN_FILES = (__file__, asyncio.__file__.rsplit("/", 1)[0])  # frames that are never the cause
_OURS = "/kvtier/"  # frames in here (or in examples/) name who asked for what stalled


@dataclass
class Stall:
    """One span in which the loop ran no heartbeat for longer than the threshold."""

    started: float  # perf_counter when the heartbeat was last seen before the stall
    seconds: float  # from that heartbeat to the next one
    samples: list[str] = field(default_factory=list)  # the loop thread's innermost own frames
    busy: list[str] = field(default_factory=list)  # other threads seen running Python meanwhile
    gc_seconds: float = 0.0  # collector time inside the span

    def culprit(self) -> str:
        """The frame seen most often during the stall (or the collector, when it took most of
        it)."""
        if self.gc_seconds >= self.seconds / 2:
            return "gc collection"
        if not self.samples:
            return "unsampled (C code holding the interpreter lock, or the lock's hand-over)"
        return collections.Counter(self.samples).most_common(1)[0][0]


def _where(frame: FrameType | None, depth: int) -> str:
    """The innermost ``depth`` frames of ``frame`` outside asyncio and this module, innermost
    first, then the innermost frame of kvtier or of the examples (who asked for it)."""
    stack = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(_OWN_FILES)]
    if not stack:
        return "the loop's own select/scheduling"
    parts = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in stack[-depth:]]
    where = " <- ".join(reversed(parts))
    ours = [f for f in stack[:-depth] if _OURS in f.filename or "/examples/" in f.filename]
    if ours:
        caller = ours[-1]
        folder, name = caller.filename.rsplit("/", 2)[-2:]
        where += f" [from {folder}/{name}:{caller.lineno} {caller.name}]"
    return where


_WAITS = ("wait", "get", "select", "poll", "acquire", "sleep", "_wait_for_tstate_lock")
_WAITING_CALLS = (".get(", ".wait(", ".acquire(", ".select(", "sleep(")  # C calls that wait


def _running(frames: dict[int, FrameType], skip: tuple[int, ...]) -> list[str]:
    """The other threads whose innermost Python frame is not a wait: those that may hold the
    interpreter lock (or a core) the loop waited for, by thread name and frame."""
    names = {t.ident: t.name for t in threading.enumerate()}
    running = []
    for ident, frame in frames.items():
        if ident in skip or frame.f_code.co_name in _WAITS:
            continue
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if any(call in line for call in _WAITING_CALLS):
            continue  # in a wait implemented in C (no frame of its own)
        name = names.get(ident, "?").rstrip("0123456789 ")
        running.append(
            f"{name}: {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
        )
    return running


class StallProbe:
    """Records every loop stall over ``threshold`` seconds with what the loop thread ran."""

    def __init__(self, threshold: float = 0.020, *, beat: float = 0.002, depth: int = 3) -> None:
        if not 0 < beat < threshold:
            raise ValueError(
                f"beat ({beat}) must be positive and below threshold ({threshold}): the "
                "heartbeat must run several times within a stall to be able to see one"
            )
        self.threshold = threshold
        self.beat = beat
        self.depth = depth
        self.stalls: list[Stall] = []
        self._last_beat = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._loop_thread = 0
        self._gc_started = 0.0
        self._gc_spans: list[tuple[float, float]] = []

    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._last_beat = time.perf_counter()
        self._tick(loop)
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._watch, name="stall-probe", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        gc.callbacks.remove(self._on_gc)
        if self._thread is not None:
            self._thread.join()
        for stall in self.stalls:
            end = stall.started + stall.seconds
            stall.gc_seconds = sum(
                max(0.0, min(end, stop) - max(stall.started, start))
                for start, stop in self._gc_spans
            )

    def summary(self, top: int = 8) -> dict[str, Any]:
        """The stalls by culprit: how many, their total and longest seconds, longest first."""
        by_culprit: dict[str, list[float]] = collections.defaultdict(list)
        busy: collections.Counter[str] = collections.Counter()
        for stall in self.stalls:
            by_culprit[stall.culprit()].append(stall.seconds)
            busy.update(set(stall.busy))
        ranked = sorted(by_culprit.items(), key=lambda item: max(item[1]), reverse=True)
        return {
            "threshold_ms": self.threshold * 1e3,
            "stalls": len(self.stalls),
            "longest_ms": max((s.seconds for s in self.stalls), default=0.0) * 1e3,
            "culprits": [
                {
                    "where": where,
                    "count": len(spans),
                    "total_ms": sum(spans) * 1e3,
                    "longest_ms": max(spans) * 1e3,
                }
                for where, spans in ranked[:top]
            ],
            "busy_threads": dict(busy.most_common(top)),  # stalls in which each was running
        }

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last_beat = time.perf_counter()
        if not self._stop.is_set():
            self._handle = loop.call_later(self.beat, self._tick, loop)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self._loop_thread:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_spans.append((self._gc_started, time.perf_counter()))

    def _watch(self) -> None:
        current: Stall | None = None
        while not self._stop.wait(self.beat):
            beat = self._last_beat
            late = time.perf_counter() - beat
            if current is not None and beat != current.started:
                current.seconds = beat - current.started
                self.stalls.append(current)
                current = None
            if late <= self.threshold:
                continue
            if current is None:
                current = Stall(beat, late)
            frames = sys._current_frames()
            current.samples.append(_where(frames.get(self._loop_thread), self.depth))
            current.busy.extend(_running(frames, (self._loop_thread, threading.get_ident())))
