"""Which stored blocks each secondary tier is asked to write, and when (docs/design.md, "Tiers,
writes and cost").

Write-through gives every tier every stored block at once. A tier that falls behind (a remote
store under load, a hung mount) then holds pinned slots, in-flight bytes and worker time that
the engine needs. This policy lets each tier yield instead:

- **Back-pressure.** A tier whose write latency (a moving average) is above
  ``max_write_latency``, whose oldest write in flight has run ``STUCK_FACTOR`` times longer
  than that (a hung tier never reports a latency; a burst queued behind a few writer threads
  must not look hung), or whose in-flight bytes would pass ``max_in_flight_bytes``, is
  not given new blocks; each block it is not given is counted as dropped, by cause. While the
  latency keeps it closed, one write is let through every ``probe_interval`` seconds to
  measure it again, so the tier is admitted again once it has recovered.
- **Rate.** A tier with a ``max_write_rate`` is given at most that many bytes per second
  (a token bucket holding one second's worth, or the most bytes ever asked for at once if
  that is more: a group of deferred writes to a packing tier must fit in it); a write past
  it is dropped (cause ``rate``).
- **Write-back.** A tier named in ``write_back`` is not written on store: the manager keeps
  the block in the pool, not evictable, and writes it to that tier when it must make room
  (or at close). For tiers where every write costs money or bandwidth. The blocks wait in
  a ``WriteBackQueue`` (``kvtier.writes._writeback``).
- **Deferred writes.** For a tier named in ``deferred``, a write that back-pressure drops is
  not forgotten: its key waits in a bounded queue (``DeferredWrites``, in
  ``kvtier.writes._deferred``), and once the tier has room again the manager copies the block to
  it from a faster tier that holds it. A remote tier shared by several nodes then gets every
  block, at the pace it can take, without the pool pinning anything for it and without its
  writes crowding the request path. (The first write-through tier has no faster tier to
  copy from: naming it here changes nothing.) A tier that packs stores arriving together
  (``SecondaryTier.write_batch`` > 1) is given its deferred writes in groups, each group
  admitted whole or not at all (``admit`` and ``has_room`` with ``count``), so that a rate
  limit lets a group through when it has a group's worth instead of one block each time it
  refills.

- **Unavailable tiers.** A tier the manager could not open yet (``set_available``) takes no
  writes at all: each one is dropped (cause ``unavailable``), a write-back skips it, and
  its deferred writes wait until it joins (only the manager saying so makes room).

This module is the per-tier gates: the latency rule, the in-flight limit and the rate
bucket of each tier. The interface is synchronous (``admit`` / ``finished``), with times from
``clock``, so every rule is tested without an event loop and with a fake clock; the queues
ask it whether their writes may go.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from kvtier.common._arguments import positive_int, positive_number
from kvtier.common._errors import InvalidArgumentError

__all__ = [
    "CAUSE_IN_FLIGHT",
    "CAUSE_LATENCY",
    "CAUSE_RATE",
    "CAUSE_UNAVAILABLE",
    "DROP_CAUSES",
    "AdmissionPolicy",
    "AdmissionStatistics",
]

CAUSE_LATENCY = "latency"
STUCK_FACTOR = 4.0
CAUSE_IN_FLIGHT = "in_flight"
CAUSE_RATE = "rate"
CAUSE_UNAVAILABLE = "unavailable"
DROP_CAUSES = (CAUSE_IN_FLIGHT, CAUSE_LATENCY, CAUSE_RATE, CAUSE_UNAVAILABLE)
"""Every cause admission drops a write for: the metrics export each at 0 before its first
drop, so rate() and alerts see a drop from the first one."""


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    """One tier's admission state and counts."""

    name: str
    write_back: bool
    admitted: int
    dropped_by_cause: dict[str, int]
    probes: int
    in_flight_bytes: int
    write_latency_seconds: float | None
    """Moving average of one write to this tier, failures included."""
    closed: bool
    """Whether the latency rule refuses new writes right now."""

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by_cause.values())


class _Gate:
    __slots__ = (
        "admitted",
        "dropped",
        "in_flight",
        "largest_ask",
        "last_cause",
        "last_probe",
        "latency",
        "probes",
        "refilled_at",
        "started",
        "tokens",
    )

    def __init__(self) -> None:
        self.started: deque[float] = deque()  # start times of the writes in flight, oldest first
        self.admitted = 0
        self.dropped: dict[str, int] = {}
        self.probes = 0
        self.in_flight = 0
        self.last_cause = ""  # why the last write was refused
        self.latency: float | None = None
        self.last_probe = -math.inf
        self.tokens = math.inf  # bytes the rate limit lets through now (full at first)
        self.refilled_at = -math.inf
        self.largest_ask = 0  # the most bytes asked at once: the bucket holds at least that


class AdmissionPolicy:
    """Per-tier admission of write-through, with back-pressure and an optional write-back.

    ``max_in_flight_bytes``: a tier's own limit on bytes being written, the same for every
    tier or a mapping from tier name to limit (None, or a tier not in the mapping: only the
    manager's global limit applies). ``max_write_latency``: seconds a write may take on
    average before the tier is closed to new blocks (None: latency never closes it).
    ``max_write_rate``: bytes per second a tier may be given on average (bursts up to one
    second's worth), the same for every tier or a mapping from tier name to rate (None, or a
    tier not in the mapping: no rate limit); it bounds the CPU and bandwidth that writes to
    an expensive remote tier take from the engine. ``deferred``: tiers whose dropped writes
    are kept and written later (see the module docstring).
    """

    def __init__(
        self,
        *,
        max_in_flight_bytes: int | Mapping[str, int] | None = None,
        max_write_latency: float | None = 0.25,
        probe_interval: float = 1.0,
        alpha: float = 0.3,
        write_back: Collection[str] = (),
        deferred: Collection[str] = (),
        max_write_rate: float | Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_in_flight_bytes, Mapping):
            for name, limit in max_in_flight_bytes.items():
                positive_int(limit, f"max_in_flight_bytes[{name!r}]")
            self._caps: Mapping[str, int] | None = dict(max_in_flight_bytes)
            self._cap: int | None = None
        else:
            if max_in_flight_bytes is not None:
                positive_int(max_in_flight_bytes, "max_in_flight_bytes", ", a mapping or None")
            self._caps, self._cap = None, max_in_flight_bytes
        if max_write_latency is not None:
            positive_number(max_write_latency, "max_write_latency", " or None")
        if isinstance(max_write_rate, Mapping):
            self._rates: Mapping[str, float] | None = {
                name: positive_number(rate, f"max_write_rate[{name!r}]")
                for name, rate in max_write_rate.items()
            }
            self._rate: float | None = None
        else:
            if max_write_rate is not None:
                positive_number(max_write_rate, "max_write_rate", " (bytes per second) or None")
            self._rates, self._rate = None, max_write_rate
        if isinstance(write_back, str):
            raise InvalidArgumentError("write_back must be a collection of tier names, not a str")
        if isinstance(deferred, str):
            raise InvalidArgumentError("deferred must be a collection of tier names, not a str")
        if set(deferred) & set(write_back):
            raise InvalidArgumentError(
                f"tiers {sorted(set(deferred) & set(write_back))} are named in both write_back "
                "and deferred; a write-back tier is never written on store, so name it once"
            )
        if not 0 < alpha <= 1 or isinstance(alpha, bool):
            raise InvalidArgumentError(f"alpha must be in (0, 1], got {alpha!r}")
        self.max_write_latency = max_write_latency
        self._probe_interval = positive_number(probe_interval, "probe_interval")
        self._alpha = float(alpha)
        self.write_back_tiers = frozenset(write_back)
        self.deferred_tiers = frozenset(deferred)
        self.clock = clock
        # A tier's gate is made at its first write; ``get`` reads without making one.
        self._gates: defaultdict[str, _Gate] = defaultdict(_Gate)
        self._unavailable: set[str] = set()  # tiers that are not open: no write goes there

    def set_available(self, tier: str, available: bool) -> None:
        """Whether ``tier`` is open and takes writes (the manager says so as a tier that
        could not open is retried and joins). While it is not, ``admit`` drops every write
        to it (cause ``unavailable``) and ``has_room`` says no, even at close."""
        if available:
            self._unavailable.discard(tier)
        else:
            self._unavailable.add(tier)

    def is_available(self, tier: str) -> bool:
        return tier not in self._unavailable

    def is_write_back(self, tier: str) -> bool:
        return tier in self.write_back_tiers

    def _cap_of(self, tier: str) -> int | None:
        return self._cap if self._caps is None else self._caps.get(tier)

    def _rate_of(self, tier: str) -> float | None:
        return self._rate if self._rates is None else self._rates.get(tier)

    def _rate_allows(self, gate: _Gate, tier: str, nbytes: int, now: float) -> bool:
        """Refill ``gate``'s token bucket and say whether it holds ``nbytes``."""
        rate = self._rate_of(tier)
        if rate is None:
            return True
        gate.largest_ask = max(gate.largest_ask, nbytes)
        burst = max(rate, float(gate.largest_ask))
        gate.tokens = min(burst, gate.tokens + (now - gate.refilled_at) * rate)
        gate.refilled_at = now
        return gate.tokens >= nbytes

    def is_deferred(self, tier: str) -> bool:
        return tier in self.deferred_tiers

    def has_room(
        self, tier: str, nbytes: int, *, ignore_latency: bool = False, count: int = 1
    ) -> bool:
        """Whether ``admit`` would take ``count`` writes of ``nbytes`` now (asking counts
        nothing); with ``ignore_latency``, whether the tier's in-flight limit would."""
        if tier in self._unavailable:
            return False
        gate = self._gates.get(tier)
        if gate is None:
            return True
        cap = self._cap_of(tier)
        total = nbytes * count
        if cap is not None and gate.in_flight + total > cap:
            return False
        if not ignore_latency and not self._rate_allows(gate, tier, total, self.clock()):
            return False
        if not ignore_latency and self.is_closed(tier):  # only the probe admit lets through
            return not gate.in_flight and self.clock() - gate.last_probe >= self._probe_interval
        return True

    def ready_in(self, tier: str, nbytes: int, *, count: int = 1) -> float | None:
        """Seconds until the passing of time alone lets ``has_room`` take ``count`` writes
        of ``nbytes`` (0: it does now): the rate budget refilling, a latency probe coming
        due. None when only a write ending can make room (the tier's in-flight limit, or a
        tier closed by latency with a write in flight, a tier not open yet); the caller
        hears of those anyway."""
        if tier in self._unavailable:
            return None
        gate = self._gates.get(tier)
        if gate is None:
            return 0.0
        cap = self._cap_of(tier)
        total = nbytes * count
        if cap is not None and gate.in_flight + total > cap:
            return None
        now = self.clock()
        wait = 0.0
        rate = self._rate_of(tier)
        if rate is not None and not self._rate_allows(gate, tier, total, now):
            wait = (total - gate.tokens) / rate
        if self.is_closed(tier):
            if gate.in_flight:
                return None
            wait = max(wait, gate.last_probe + self._probe_interval - now)
        return max(wait, 0.0)

    def capacity(self, tier: str, nbytes: int) -> int | None:
        """How many writes of ``nbytes`` the tier's in-flight limit holds at once (None: no
        limit of its own). A group larger than this would never be admitted whole."""
        cap = self._cap_of(tier)
        return None if cap is None else cap // nbytes

    def is_closed(self, tier: str) -> bool:
        """Whether the latency rule refuses new writes to ``tier`` right now: its writes
        average too long, or its oldest write in flight has run ``STUCK_FACTOR`` times too
        long already."""
        gate = self._gates.get(tier)
        limit = self.max_write_latency
        if gate is None or limit is None:
            return False
        if gate.latency is not None and gate.latency > limit:
            return True
        # Writes end roughly in the order they start, so the oldest start stands for the
        # oldest write still running.
        return bool(gate.started) and self.clock() - gate.started[0] > limit * STUCK_FACTOR

    def write_latency(self, tier: str) -> float | None:
        """The moving average of one write to ``tier`` (None before the first)."""
        gate = self._gates.get(tier)
        return None if gate is None else gate.latency

    def admit(self, tier: str, nbytes: int, *, count: int = 1) -> bool:
        """Whether ``tier`` takes ``count`` writes of ``nbytes`` now, all of them or none
        (a group of deferred writes to a packing tier). True reserves the bytes (give each
        write's back with ``finished`` or ``cancel``); False counts ``count`` dropped writes.
        A tier the latency rule closed takes the group as its one probe."""
        gate = self._gates[tier]
        if self._unavailable and tier in self._unavailable:
            return self._drop(gate, CAUSE_UNAVAILABLE, count)
        cap = self._cap_of(tier)
        total = nbytes * count
        if cap is not None and gate.in_flight + total > cap:
            return self._drop(gate, CAUSE_IN_FLIGHT, count)
        now = self.clock()
        if not self._rate_allows(gate, tier, total, now):
            return self._drop(gate, CAUSE_RATE, count)
        if self.is_closed(tier):
            if gate.in_flight or now - gate.last_probe < self._probe_interval:
                return self._drop(gate, CAUSE_LATENCY, count)
            gate.last_probe = now  # one probe, alone, to measure the tier again
            gate.probes += 1
        self._reserve(gate, total, count, now)
        return True

    def force(self, tier: str, nbytes: int, *, count: int = 1) -> None:
        """Reserve ``count`` writes that must happen whatever the state (write-back and
        deferred writes at close)."""
        self._reserve(self._gates[tier], nbytes * count, count, self.clock())

    @staticmethod
    def _reserve(gate: _Gate, total: int, count: int, now: float) -> None:
        gate.tokens -= total
        gate.admitted += count
        gate.in_flight += total
        gate.started.extend([now] * count)

    def _drop(self, gate: _Gate, cause: str, count: int = 1) -> bool:
        gate.dropped[cause] = gate.dropped.get(cause, 0) + count
        gate.last_cause = cause
        return False

    def refuse_again(self, tier: str, count: int = 1) -> None:
        """Count ``count`` more writes to ``tier`` dropped for the cause of its last refusal:
        the later blocks of a store whose earlier block ``admit`` refused, which nothing could
        have let in since (no write ends within one store's routing)."""
        gate = self._gates[tier]
        self._drop(gate, gate.last_cause, count)

    def last_refusal(self, tier: str) -> str:
        """Why ``admit`` last refused a write to ``tier`` (a cause such as ``"rate"``)."""
        gate = self._gates.get(tier)
        return "" if gate is None else gate.last_cause

    def cancel(self, tier: str, nbytes: int) -> None:
        """Give back an admission that was not used (no write happened: no latency sample)."""
        gate = self._gates[tier]
        gate.in_flight = max(gate.in_flight - nbytes, 0)
        gate.tokens += nbytes
        gate.admitted -= 1
        if gate.started:
            gate.started.pop()

    def finished(self, tier: str, nbytes: int, seconds: float) -> None:
        """An admitted write of ``nbytes`` ended after ``seconds`` (failed, timed out or
        cancelled writes too: each says how long the tier held the bytes)."""
        gate = self._gates[tier]
        gate.in_flight = max(gate.in_flight - nbytes, 0)
        if gate.started:
            gate.started.popleft()
        gate.latency = _ewma(gate.latency, max(float(seconds), 0.0), self._alpha)

    def observe_write_latency(self, tier: str, seconds: float) -> None:
        """A write latency measured elsewhere (a tier's own client, an earlier run)."""
        gate = self._gates[tier]
        gate.latency = _ewma(gate.latency, max(float(seconds), 0.0), self._alpha)

    def dropped(self) -> int:
        return sum(sum(g.dropped.values()) for g in self._gates.values())

    def statistics(self, tiers: Collection[str] = ()) -> tuple[AdmissionStatistics, ...]:
        """Per tier: those named (in that order), then any other tier seen."""
        names = list(tiers) + [name for name in self._gates if name not in tiers]
        out = []
        for name in names:
            gate = self._gates[name]
            out.append(
                AdmissionStatistics(
                    name=name,
                    write_back=self.is_write_back(name),
                    admitted=gate.admitted,
                    dropped_by_cause=dict(gate.dropped),
                    probes=gate.probes,
                    in_flight_bytes=gate.in_flight,
                    write_latency_seconds=gate.latency,
                    closed=self.is_closed(name),
                )
            )
        return tuple(out)

    def __repr__(self) -> str:
        closed = [name for name in self._gates if self.is_closed(name)]
        return (
            f"<AdmissionPolicy write_back={sorted(self.write_back_tiers)} closed={closed} "
            f"unavailable={sorted(self._unavailable)} "
            f"dropped={self.dropped()}>"
        )


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)
