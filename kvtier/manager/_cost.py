"""What waiting for a tier costs against what recomputing costs: kvtier's "never slower than
recompute" rule, as a small synchronous model (docs/design.md, "Tiers, writes and cost").

The manager feeds it each promotion's duration and size, per tier; the engine feeds it what
prefill costs (once, with ``set_recompute_cost``, or as it runs, with ``observe_recompute``).
Each async lookup carries a ``ScanBudget`` (its deadline: when recomputing its blocks past
the resident prefix would be done) and two questions are asked of the model:

- ``promote_before(tier, deadline, now)`` (by the manager): can this tier deliver a block
  before recomputing would have finished? If not, the block is not promoted for this request.
- ``keep_waiting(...)`` (by the scheduler): a request never waits longer in all than that
  recompute would take, and stops at once when the blocks it waits for are expected later.

Everything here is plain arithmetic on numbers the callers pass in (``now`` included, from the
model's ``clock``), so it is tested without an event loop and with a fake clock. Estimates are
exponentially weighted moving averages: cheap, bounded state, and they follow a tier that
slows down or recovers within a few samples. A tier whose estimate says "too slow" still gets
one promotion every ``probe_interval`` seconds, so the estimate can see it recover.

A promotion's time depends on how many others from the same tier run beside it: a request
that promotes 60 blocks at once sees its last ones land after the tier has served the other
59. A plain average of those durations would call the tier slow for seconds after the burst
has drained, and decline promotions that would have landed at once. So each promotion is
observed with the number already in flight when it began (``queued``), and the model keeps
two averages: the duration of a promotion that found the tier idle, and what each promotion
already in flight adds. The expected latency of a promotion started now is the first plus
the second times the tier's promotions in flight now (``promotion_started`` and
``promotion_finished`` keep that count).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.common._arguments import positive_number
from kvtier.common._errors import InvalidArgumentError
from kvtier.common._lookup import LookupResult

__all__ = ["CostModel", "CostStatistics", "ScanBudget", "TierCost"]


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


def _non_negative(value: object, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class TierCost:
    """One tier's promotion estimates (None until its first promotion)."""

    name: str
    promotions: int
    failures: int
    latency_seconds: float | None
    """Moving average of one promotion, start to readable, failures included."""
    idle_latency_seconds: float | None
    """Moving average of one promotion that found no other from this tier in flight."""
    queued_seconds: float | None
    """What each promotion already in flight adds to a new one's latency (moving average)."""
    in_flight: int
    """Promotions from this tier running now."""
    throughput_bytes_per_second: float | None
    """Moving average of one successful promotion's bytes per second."""
    declined: int
    """Promotions not started because the tier was expected later than recompute."""
    probes: int
    """Promotions let through anyway, to re-measure a tier that was too slow."""


@dataclass(frozen=True, slots=True)
class CostStatistics:
    """What the cost model has learnt: the engine's recompute cost per block and each tier's
    load cost, the figures that decide whether a promotion or a wait is worth it."""

    recompute_seconds_per_block: float | None
    recompute_observations: int
    waits_cut: int
    """Async lookups that stopped waiting because recomputing was expected to be cheaper."""
    tiers: tuple[TierCost, ...]


class _Tier:
    __slots__ = (
        "declined",
        "failures",
        "idle",
        "in_flight",
        "last_probe",
        "latency",
        "per_queued",
        "probes",
        "promotions",
        "rate",
    )

    def __init__(self) -> None:
        self.latency: float | None = None
        self.idle: float | None = None  # a promotion that found the tier idle
        self.per_queued: float | None = None  # added by each promotion already in flight
        self.in_flight = 0
        self.rate: float | None = None
        self.promotions = 0
        self.failures = 0
        self.declined = 0
        self.probes = 0
        self.last_probe = -math.inf


class ScanBudget:
    """One async lookup's view for the manager, passed as the ``ctx`` of its lookups.

    The scheduler's scan asks every key through ``ask``, which tells the manager two things
    about the key before it is looked up:

    - ``blocker``: the first key before it in the prefix whose existence is still unknown
      (lazy promotion: the prefix may end there, so a tier hit after it is not promoted yet;
      the manager answers RETRY and wakes this key when the blocker changes). None when
      there is none, when ``lazy`` is off (window scans) or when ``promote`` is off (the
      request stopped waiting: nothing more is promoted for it).
    - ``deadline``: the clock time by which recomputing the request's blocks past its
      resident prefix would have finished (set at the first non-resident key; None without
      a recompute estimate): a tier expected later is not promoted for this request.

    The manager answers back through ``unknown`` (this key's existence is still being
    checked) and ``expect`` (when the blocks the scan waits for should land).
    """

    __slots__ = (
        "_heap",
        "_keys",
        "_lookup",
        "_planned",
        "_positions",
        "_unknown",
        "blocker",
        "deadline",
        "expected_ready",
        "lazy",
        "per_block",
        "promote",
        "started",
        "unknown",
    )

    def __init__(
        self,
        lookup: Callable[[bytes, ScanBudget | None], LookupResult],
        keys: Sequence[bytes],
        started: float,
        per_block: float | None,
        *,
        lazy: bool = True,
    ) -> None:
        self._lookup = lookup
        self._keys = keys
        self.started = started
        self.per_block = per_block
        self.lazy = lazy
        self.promote = True
        self.deadline: float | None = None
        self._planned = False
        self.blocker: bytes | None = None
        self.unknown = False
        self.expected_ready = -math.inf
        self._positions: dict[bytes, int] | None = None  # built at the first ask
        self._unknown: set[int] = set()  # positions whose existence was unknown when asked
        self._heap: list[int] = []  # the same positions (and stale ones), smallest first

    def ask(self, key: bytes, ctx: ScanBudget | None = None) -> LookupResult:
        """``manager.lookup(key, self)``, with this key's blocker set and its answer noted."""
        positions = self._positions
        if positions is None:  # not for requests answered by the pool alone
            keys = self._keys  # each key's first position, built at C speed
            backwards = range(len(keys) - 1, -1, -1)
            positions = self._positions = dict(zip(reversed(keys), backwards, strict=True))
        position = positions.get(key, 0)
        if not self._planned:  # the first key asked is the first one past the resident run
            self._planned = True
            if self.per_block is not None:
                blocks = len(self._keys) - (position if self.lazy else 0)
                self.deadline = self.started + self.per_block * blocks
        self.blocker = self._first_unknown_before(position)
        self.unknown = False
        result = self._lookup(key, self)
        if self.unknown:
            if position not in self._unknown:
                self._unknown.add(position)
                heapq.heappush(self._heap, position)
        else:
            self._unknown.discard(position)
        return result

    def _first_unknown_before(self, position: int) -> bytes | None:
        if not self.promote:
            return self._keys[position]  # promote nothing; wake on the key itself
        if not self.lazy:
            return None
        heap = self._heap
        while heap and heap[0] not in self._unknown:
            heapq.heappop(heap)  # resolved since
        return self._keys[heap[0]] if heap and heap[0] < position else None

    def expect(self, ready_at: float) -> None:
        """A block the scan waits for should land at ``ready_at`` (the latest one counts)."""
        if ready_at > self.expected_ready:
            self.expected_ready = ready_at


class CostModel:
    """Per-tier promotion estimates and the engine's recompute cost.

    ``recompute_seconds_per_block``: what prefilling one block costs the engine, if known up
    front; ``observe_recompute`` refines it (or supplies it) as the engine runs. Without it the
    scheduler behaves as it always did: it waits up to the caller's timeout.
    """

    def __init__(
        self,
        *,
        recompute_seconds_per_block: float | None = None,
        alpha: float = 0.2,
        probe_interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < alpha <= 1 or isinstance(alpha, bool):
            raise InvalidArgumentError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = float(alpha)
        self._probe_interval = positive_number(probe_interval, "probe_interval")
        self.clock = clock
        self._recompute: float | None = None
        self._recompute_observations = 0
        if recompute_seconds_per_block is not None:
            self.set_recompute_cost(recompute_seconds_per_block)
        self._tiers: dict[str, _Tier] = {}
        self._waits_cut = 0

    # -- the engine's side ---------------------------------------------------------------------

    def set_recompute_cost(self, seconds_per_block: float | None) -> None:
        """Prefill seconds per block (None: unknown, wait as long as the caller allows)."""
        self._recompute = (
            None
            if seconds_per_block is None
            else _non_negative(seconds_per_block, "seconds_per_block")
        )

    def observe_recompute(self, blocks: int, seconds: float) -> None:
        """The engine prefilled ``blocks`` blocks in ``seconds``: update the per-block cost."""
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise InvalidArgumentError(f"blocks must be an int >= 0, got {blocks!r}")
        seconds = _non_negative(seconds, "seconds")
        if blocks == 0:
            return
        self._recompute = _ewma(self._recompute, seconds / blocks, self._alpha)
        self._recompute_observations += 1

    @property
    def recompute_seconds_per_block(self) -> float | None:
        return self._recompute

    def recompute_seconds(self, blocks: int) -> float | None:
        """What recomputing ``blocks`` blocks is expected to cost; None when unknown."""
        return None if self._recompute is None else self._recompute * max(blocks, 0)

    # -- the manager's side --------------------------------------------------------------------

    def _tier(self, name: str) -> _Tier:
        tier = self._tiers.get(name)
        if tier is None:
            tier = self._tiers[name] = _Tier()
        return tier

    def promotion_started(self, tier: str) -> int:
        """A promotion from ``tier`` begins: returns how many from it were already in flight
        (pass it back as ``observe_promotion``'s ``queued``). Pair with
        ``promotion_finished``, whatever the outcome."""
        state = self._tier(tier)
        queued = state.in_flight
        state.in_flight += 1
        return queued

    def promotion_finished(self, tier: str) -> None:
        state = self._tier(tier)
        state.in_flight = max(state.in_flight - 1, 0)

    def observe_promotion(
        self, tier: str, seconds: float, nbytes: int, ok: bool, *, queued: int = 0
    ) -> None:
        """One promotion from ``tier`` ended after ``seconds``, having started with ``queued``
        others from the tier in flight; a failure (a timeout, say) still says how long the
        tier made a request wait."""
        state = self._tier(tier)
        seconds = max(float(seconds), 0.0)
        queued = max(int(queued), 0)
        state.last_probe = self.clock()  # a fresh measurement: the next probe can wait
        state.latency = _ewma(state.latency, seconds, self._alpha)
        if queued == 0 or state.idle is None:
            # Before any idle sample, a queued one is split evenly: a first guess that the
            # tier served the queue one promotion at a time.
            share = seconds / (queued + 1)
            state.idle = _ewma(state.idle, share, self._alpha)
            if queued and state.per_queued is None:
                state.per_queued = share
        else:
            added = max(seconds - state.idle, 0.0) / queued
            state.per_queued = _ewma(state.per_queued, added, self._alpha)
        if ok:
            state.promotions += 1
            if seconds > 0:
                state.rate = _ewma(state.rate, nbytes / seconds, self._alpha)
        else:
            state.failures += 1

    def expected_latency(self, tier: str) -> float | None:
        """How long a promotion from ``tier`` started now should take, given the tier's
        promotions in flight; None before its first measurement."""
        state = self._tiers.get(tier)
        return None if state is None else self._expected(state)

    @staticmethod
    def _expected(state: _Tier) -> float | None:
        if state.idle is None:
            return None
        return state.idle + state.in_flight * (state.per_queued or 0.0)

    def promote_before(self, tier: str, deadline: float | None, now: float) -> bool:
        """Whether to promote a block from ``tier`` for a request whose recompute would be
        done at ``deadline``: yes when the tier is expected in time, when nothing is known
        (no deadline, or no estimate yet: measuring needs a first promotion), or when the
        tier is due a probe (``probe_interval`` after its last measurement)."""
        state = self._tier(tier)
        expected = self._expected(state)
        if deadline is None or expected is None or now + expected <= deadline:
            return True
        if now - state.last_probe >= self._probe_interval:
            state.last_probe = now
            state.probes += 1
            return True
        state.declined += 1
        return False

    # -- the scheduler's side ------------------------------------------------------------------

    def keep_waiting(
        self, started: float, now: float, expected_ready: float, budget: float
    ) -> bool:
        """Whether a request that began waiting at ``started`` should wait on for blocks
        expected at ``expected_ready``, when recomputing them costs ``budget`` seconds: only
        if its whole wait is expected to end within that budget. Counts the cuts."""
        if max(now, expected_ready) - started <= budget:
            return True
        self._waits_cut += 1
        return False

    def statistics(self) -> CostStatistics:
        return CostStatistics(
            recompute_seconds_per_block=self._recompute,
            recompute_observations=self._recompute_observations,
            waits_cut=self._waits_cut,
            tiers=tuple(
                TierCost(
                    name=name,
                    promotions=t.promotions,
                    failures=t.failures,
                    latency_seconds=t.latency,
                    idle_latency_seconds=t.idle,
                    queued_seconds=t.per_queued,
                    in_flight=t.in_flight,
                    throughput_bytes_per_second=t.rate,
                    declined=t.declined,
                    probes=t.probes,
                )
                for name, t in self._tiers.items()
            ),
        )

    def __repr__(self) -> str:
        tiers = ", ".join(
            f"{name}={t.idle * 1e3:.1f}ms" if t.idle is not None else f"{name}=?"
            for name, t in self._tiers.items()
        )
        recompute = "?" if self._recompute is None else f"{self._recompute * 1e3:.2f}ms/block"
        return f"<CostModel recompute={recompute} tiers=[{tiers}] waits_cut={self._waits_cut}>"
