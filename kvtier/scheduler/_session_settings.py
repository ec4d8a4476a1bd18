"""How an ``OffloadScheduler`` brings sessions back and keeps them: ``SessionSettings``, one
frozen object with every setting's default and validation (the session table reads it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.common._errors import InvalidArgumentError

__all__ = ["SessionSettings"]


def _share(value: object, name: str, *, open_low: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0 < value < 1 if open_low else 0 <= value <= 1)
    ):
        bounds = "strictly between 0 and 1" if open_low else "from 0 to 1"
        raise InvalidArgumentError(f"{name} must be a number {bounds}, got {value!r}")


def _positive(value: object, name: str, *, integer: bool = False) -> None:
    kinds = int if integer else int | float
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or not math.isfinite(value)
        or value <= 0
    ):
        what = "int" if integer else "number"
        raise InvalidArgumentError(f"{name} must be a positive {what}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """How an ``OffloadScheduler`` brings sessions back (``OffloadScheduler(...,
    sessions=SessionSettings(...))``)."""

    share: float = 0.25
    """Share of the pool's slots all bring-backs together may hold (pins, and promotions in
    flight): a wrong guess costs at most this. Separate from ``prefetch_share``, so guesses
    never crowd out queued requests' prefetches."""
    max_running: int = 4
    """Bring-backs scanning and promoting at once; due ones wait their turn, earliest first."""
    ready_quantile: float = 0.1
    """Without a hint, aim to have the prefix back before this share of predicted returns."""
    stale_quantile: float = 0.99
    """Without a hint, stop holding the prefix once this share of returns would have come.
    High because a guess is cheap to hold: it pins only what it promoted into spare slots
    (within ``share``), and letting go before the turn comes wastes what it fetched."""
    quiet_quantile: float = 0.99
    """A session still away once this share of the predicted returns would have come (the
    later of its own prediction and the workload's; the hazard of a heavy-tailed gap falls
    the longer a session is away) has gone quiet: its private blocks become the next to
    leave the pool, as an ended session's do. High on purpose: a live session's blocks let
    go too early cost its next turn, and a session that ended says so (``end()``)."""
    hint_slack: float = 1.0
    """With ``expect_back_in=x``, stop holding after ``x * (1 + hint_slack)``."""
    min_hold: float = 5.0
    """Seconds a plan holds at least past its expected return: a turn a little late (a
    hint of a return in a millisecond, a busy engine) still finds its prefix."""
    prior_gap: float = 30.0
    """Seconds: the gap between turns assumed before the workload has shown one."""
    prior_spread: float = 1.0
    """Standard deviation of the log of the gap assumed before the workload has shown two."""
    prior_weight: float = 2.0
    """A session's gaps count as much as the workload's once it has shown this many."""
    alpha: float = 0.3
    """Weight of a new gap in a session's moving estimates."""
    workload_alpha: float = 0.05
    """Weight of a new gap in the workload's moving estimates."""
    lead_margin: float = 1.5
    """The promotion's expected duration is multiplied by this to set its lead."""
    default_lead: float = 1.0
    """Seconds of lead before the cost model has measured a tier."""
    lead_slack: float = 0.05
    """Seconds added to every lead: what no per-block estimate covers, such as the start
    timer firing late on a busy loop and the scan's own steps behind the engine's work. A
    bring-back that has not finished when its turn arrives makes the turn wait for the rest
    on its request path; one that finished this much early only holds its pins longer."""
    max_sessions: int = 10_000
    """Sessions tracked at once; past it the least recently active one is forgotten."""
    forget_after: float = 3_600.0
    """Seconds after its last turn that a session with no hint pending is forgotten."""

    def __post_init__(self) -> None:
        _share(self.share, "share")
        _positive(self.max_running, "max_running", integer=True)
        _share(self.ready_quantile, "ready_quantile", open_low=True)
        _share(self.stale_quantile, "stale_quantile", open_low=True)
        _share(self.quiet_quantile, "quiet_quantile", open_low=True)
        if self.quiet_quantile < self.stale_quantile:
            raise InvalidArgumentError(
                "quiet_quantile must be at least stale_quantile, got "
                f"{self.quiet_quantile!r} < {self.stale_quantile!r}"
            )
        if self.stale_quantile <= self.ready_quantile:
            raise InvalidArgumentError(
                "stale_quantile must be above ready_quantile, got "
                f"{self.stale_quantile!r} <= {self.ready_quantile!r}"
            )
        for name in ("hint_slack", "min_hold", "prior_gap", "prior_spread", "prior_weight"):
            _positive(getattr(self, name), name)
        _share(self.alpha, "alpha", open_low=True)
        _share(self.workload_alpha, "workload_alpha", open_low=True)
        if isinstance(self.lead_margin, bool) or not self.lead_margin >= 1:
            raise InvalidArgumentError(f"lead_margin must be at least 1, got {self.lead_margin!r}")
        _positive(self.default_lead, "default_lead")
        if (
            isinstance(self.lead_slack, bool)
            or not isinstance(self.lead_slack, int | float)
            or not 0 <= self.lead_slack < math.inf
        ):
            raise InvalidArgumentError(
                f"lead_slack must be a non-negative number of seconds, got {self.lead_slack!r}"
            )
        _positive(self.max_sessions, "max_sessions", integer=True)
        _positive(self.forget_after, "forget_after")
