"""Which batches of one publisher a subscriber applies, by sequence: a synchronous state machine.

A PUB socket drops messages for a subscriber past its high-water mark, and a subscriber that
joins late or whose publisher restarted has seen none of what came before. The sequence number
of every batch says so: each publisher numbers its batches one after the other (vLLM's from 0,
kvtier's from its start time, so a restarted node's numbers jump ahead), so

- the next expected batch is applied, and so are those held after it;
- a later one means batches were lost: it is held (``max_held`` at most) and the repair asks for
  a replay from the first missing one (``want`` is ``"replay"``);
- a replay that ends without reaching the held batches, or a gap wider than the held batches,
  asks for the full state (``want`` is ``"full"``): the publisher no longer holds what was lost;
- a live batch whose sequence is not above the last live one means the publisher restarted
  (one connection delivers a publisher's batches in order, so live sequences only go back
  for a new publisher); one above the last live one but below the next expected was already
  covered by a replay or a full state answered on the other socket, which can overtake the
  live stream: it is dropped (``stale``);
- a live batch more than ``RESTART_JUMP`` ahead of the next expected one is a kvtier
  publisher that started again (its numbers jump by the microseconds between its starts): a
  gap as any other to repair, counted in ``restarts``, not in ``missed``;
- a batch that begins with ``AllBlocksCleared`` is a reset (a full state's first batch, or a
  restarted node's announcement): from it on the subscriber is in sync, whatever it missed
  before; a full state answered on the replay socket carries the sequence of the first live
  batch after it.

Until it has seen a reset, a subscriber that joined is not in sync: it asks for the full state
first (``want``), and applies live batches meanwhile (each event says only what happened).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.integrations._residency import CLEARED, WireEvent

__all__ = ["RESTART_JUMP", "SequenceStatistics", "SequenceTracker"]

RESTART_JUMP = 1_000_000
"""A forward gap wider than this is a publisher's restart, not batches lost: no publisher's
replay holds that many, and a kvtier publisher started a second later numbers a million on."""

Batch = list[WireEvent]


@dataclass(slots=True)
class SequenceStatistics:
    """What one subscriber saw of one publisher."""

    applied: int = 0  # batches applied
    missed: int = 0  # batches the live stream skipped (sequence gaps)
    replayed: int = 0  # batches applied from a replay
    resets: int = 0  # resets applied (full states, restarted publishers)
    restarts: int = 0  # times the live sequence went back, or jumped ahead past RESTART_JUMP
    held_dropped: int = 0  # batches past ``max_held`` while waiting for a repair
    stale: int = 0  # live batches a replay or a full state had already covered, dropped
    replays_asked: int = 0
    full_states_asked: int = 0
    gaps_seen: list[int] = field(default_factory=list)  # sizes of the last gaps (bounded)


class SequenceTracker:
    """The batches to apply, in order, and what to ask the publisher for (module doc)."""

    def __init__(self, max_held: int = 4096) -> None:
        if max_held < 1:
            raise ValueError(f"max_held must be 1 or more, got {max_held}")
        self.next: int | None = None  # the next sequence to apply; None: not in sync
        self.want: str | None = "full"  # "replay", "full" or None
        self.max_held = max_held
        self._held: dict[int, Batch] = {}
        self._last_live: int | None = None  # the sequence of the last live batch
        self.stats = SequenceStatistics()

    @property
    def in_sync(self) -> bool:
        return self.next is not None and not self._held

    def live(self, sequence: int, batch: Batch) -> list[Batch]:
        """A batch from the PUB socket; the batches to apply now, in order."""
        went_back = self._last_live is not None and sequence <= self._last_live
        self._last_live = sequence
        if went_back:  # a new publisher: nothing held or expected of the old one holds
            self.stats.restarts += 1
            self.next, self.want = None, "full"
            self._held.clear()
        elif self.next is not None and sequence < self.next:  # a repair covered it already
            self.stats.stale += 1
            return []
        if _is_reset(batch):
            return self._reset_at(sequence, batch)
        if self.next is None:
            # Held to apply again after the full state (which resets what came before it),
            # and applied now: what it says is news meanwhile.
            self._hold(sequence, batch)
            return [batch]
        if sequence > self.next:
            if sequence - self.next > RESTART_JUMP:
                self.stats.restarts += 1
            elif not self._held:
                self.stats.missed += sequence - self.next
                self.stats.gaps_seen = [*self.stats.gaps_seen[-31:], sequence - self.next]
            self._hold(sequence, batch)
            return []
        return self._apply_from(sequence, batch)

    def replayed(self, sequence: int, batch: Batch) -> list[Batch]:
        """A batch from a replay (a replay is of this publisher's history: never a restart)."""
        if self.next is None or sequence != self.next:
            return []
        self.stats.replayed += 1
        return self._apply_from(sequence, batch)

    def replay_ended(self) -> None:
        """The replay's end marker: a gap still open closes only with a full state."""
        if self.next is None:
            return
        self.want = "full" if self._held else None

    def full_state(self, after: int, batches: list[Batch]) -> list[Batch]:
        """A full state answered on the replay socket (the state of every batch before
        ``after``); the batches to apply, then the held ones that follow it."""
        if not batches or not _is_reset(batches[0]):
            return []
        self.stats.resets += 1
        self.next = after
        self._held = {s: b for s, b in self._held.items() if s >= after}
        self.stats.applied += len(batches)
        return [*batches, *self._drain()]

    def asked(self) -> str | None:
        """What to ask the publisher for now, counted; None when nothing."""
        if self.want == "replay":
            self.stats.replays_asked += 1
        elif self.want == "full":
            self.stats.full_states_asked += 1
        return self.want

    # -- helpers -------------------------------------------------------------------------------

    def _reset_at(self, sequence: int, batch: Batch) -> list[Batch]:
        self.stats.resets += 1
        self.next = sequence + 1
        self._held = {s: b for s, b in self._held.items() if s > sequence}
        self.stats.applied += 1
        return [batch, *self._drain()]

    def _hold(self, sequence: int, batch: Batch) -> None:
        if len(self._held) >= self.max_held:
            self.stats.held_dropped += 1
            self.want = "full"
            return
        self._held[sequence] = batch
        if self.want is None:
            self.want = "replay"

    def _apply_from(self, sequence: int, batch: Batch) -> list[Batch]:
        self.next = sequence + 1
        self.stats.applied += 1
        return [batch, *self._drain()]

    def _drain(self) -> list[Batch]:
        """The held batches that follow ``next`` without a gap; what to ask for after."""
        assert self.next is not None
        out = []
        while (held := self._held.pop(self.next, None)) is not None:
            out.append(held)
            self.next += 1
        self.stats.applied += len(out)
        self.want = "replay" if self._held else None
        return out


def _is_reset(batch: Batch) -> bool:
    return bool(batch) and batch[0].type == CLEARED
