"""Scans that an async lookup resumes after each wake instead of starting over.

A request that waits for a long prefix is woken once per block that lands. Rescanning and
re-pinning the whole prefix at every wake made the work quadratic in the prefix length. A resumable
scan remembers each key's last answer and asks a key again only when the manager says it changed
(``KeyWatch``), so over a whole wait each key is asked a few times and pinned once.

Why remembered answers stay true: a HIT the scan pinned cannot be evicted; every other key
the scan has seen is watched, and the manager fires the watch at its next change. Between two
fires a key can only move from RETRY to HIT_PENDING (a promotion started by the scan itself),
and both defer, so the answer (``None``) does not depend on which one is remembered.

The answers are those of the synchronous scans of docs/design.md, "The lookup contract"
(``OffloadScheduler``): a resumed scan answers what a fresh scan would answer, given the keys'
current answers. One difference from rescanning: a hit stays pinned until the async lookup returns
even if a later miss before it means the answer no longer counts it (a rescan would have let it go);
the pins are the request's own keys and are given back with the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.common._lookup import HIT, HIT_PENDING, MISS, RETRY, LookupResult
from kvtier.manager._cost import ScanBudget

__all__ = ["PrefixProgress", "WindowProgress"]


Lookup = Callable[[bytes, ScanBudget | None], LookupResult]
Pin = Callable[[Sequence[bytes]], list[int]]


def _defers(result: LookupResult | None) -> bool:
    return result is HIT_PENDING or result is RETRY


def _counts(result: LookupResult | None) -> bool:
    """Counts toward a window streak (docs/design.md, "The lookup contract"): HIT and
    HIT_PENDING."""
    return result is HIT or result is HIT_PENDING


class _Progress:
    """Per-key answers, the pins taken on hits (``lease``) and the keys to watch."""

    def __init__(self, keys: Sequence[bytes], lookup: Lookup, pin: Pin | None) -> None:
        self.keys = keys
        self._lookup = lookup
        self._pin = pin
        self._answers: list[LookupResult | None] = [None] * len(keys)  # None: ask
        # Built at the first wake: each key's first position, and all positions of the keys
        # that occur more than once (None when none does). No list per key: what a waiting
        # request holds reaches the collector's oldest generation.
        self._positions: dict[bytes, int] | None = None
        self._repeated: dict[bytes, list[int]] | None = None
        self.lease: list[int] = []
        self.watched: set[bytes] = set()  # registered with the manager, not fired yet
        self._to_watch: list[bytes] = []

    def take_watches(self) -> list[bytes]:
        """Keys seen since the last call that may still change: register them now."""
        keys, self._to_watch = self._to_watch, []
        return keys

    def _ask(self, i: int) -> LookupResult:
        key = self.keys[i]
        result = self._lookup(key, None)
        self._answers[i] = result
        if result is HIT:
            if self._pin is not None:
                self.lease += self._pin((key,))
        elif key not in self.watched:
            self.watched.add(key)
            self._to_watch.append(key)
        return result

    def _fired(self, changed: list[bytes]) -> list[int]:
        """Positions of the keys that fired, each key's watch now spent, in prefix order.

        The order matters: the manager holds a tier hit back behind the first key before it
        that was unknown when last asked (lazy promotion), and wakes it when that key changes.
        If both fired at once and the later key were asked first, it would be held behind a
        key whose change has already been delivered, and nothing would wake it again."""
        positions = self._positions
        if positions is None:
            positions = self._positions = self._index()
        repeated = self._repeated
        watched = self.watched
        fired: list[int] = []
        for key in changed:
            if key in watched:
                watched.discard(key)
                if repeated is not None and key in repeated:
                    fired += repeated[key]
                else:
                    fired.append(positions[key])
        fired.sort()
        return fired

    def _index(self) -> dict[bytes, int]:
        """Each key's first position; fills ``_repeated`` for keys that occur again."""
        keys = self.keys
        n = len(keys)
        positions = dict(zip(reversed(keys), range(n - 1, -1, -1), strict=True))
        if len(positions) < n:
            repeated: dict[bytes, list[int]] = {}
            for i, key in enumerate(keys):
                first = positions[key]
                if first != i:
                    repeated.setdefault(key, [first]).append(i)
            self._repeated = repeated
        return positions


class PrefixProgress(_Progress):
    """``maximal_prefix_lookup`` as a resumable scan.

    ``stop`` is the first MISS (or the end) and ``_deferring`` counts the keys before it that
    defer; the answer is ``stop`` once that count is zero.

    ``holds``: the caller keeps the answer's pins after the scan (a prefetch holds what it
    found until its request comes), so a prefix found whole in the pool is pinned too; a
    lookup pins its answer itself once it returns.
    """

    def __init__(
        self,
        keys: Sequence[bytes],
        lookup: Lookup,
        pin: Pin | None,
        fast_prefix: Callable[[Sequence[bytes]], int] | None,
        *,
        holds: bool = False,
    ) -> None:
        super().__init__(keys, lookup, pin)
        self._fast_prefix = fast_prefix
        self._holds = holds
        self._stop = 0
        self._deferring = 0

    def start(self) -> int | None:
        n = len(self.keys)
        if self._fast_prefix is not None:
            start = self._fast_prefix(self.keys)
            if start == n and not self._holds:
                return n  # nothing runs before the caller returns: no pins needed
            if start and self._pin is not None:
                self.lease += self._pin(self.keys[:start])
            self._answers[:start] = [HIT] * start
            self._stop = start
        self._extend()
        return self._answer()

    def resume(self, changed: list[bytes]) -> int | None:
        answers = self._answers
        for i in self._fired(changed):
            if i > self._stop:
                answers[i] = None  # beyond the first miss: ask again if the scan gets there
                continue
            old = answers[i]
            new = self._ask(i)
            if i < self._stop:
                self._deferring += _defers(new) - _defers(old)
                if new is MISS:
                    self._retreat(i)
        if self._stop < len(self.keys) and answers[self._stop] is not MISS:
            self._extend()  # the first miss is no longer one
        return self._answer()

    def _answer(self) -> int | None:
        return None if self._deferring else self._stop

    def _extend(self) -> None:
        answers = self._answers
        i, n = self._stop, len(self.keys)
        while i < n:
            result = answers[i]
            if result is None:
                result = self._ask(i)
            if result is MISS:
                break
            self._deferring += _defers(result)
            i += 1
        self._stop = i

    def _retreat(self, i: int) -> None:
        """Key ``i`` became the first miss: the keys after it no longer count."""
        answers = self._answers
        self._deferring -= sum(_defers(answers[j]) for j in range(i + 1, self._stop))
        self._stop = i


class WindowProgress(_Progress):
    """``sliding_window_lookup`` as a resumable scan.

    A pass walks from the right, as the synchronous scan does, recording the streak after
    each position. After the first pass, a pass may stop at the first key that defers (the
    answer is then None whatever lies further left), and it starts at the rightmost changed
    key with the streak recorded right of it. A wake that changes only keys left of the
    rightmost deferring key needs no pass at all; one that breaks a run of counted keys (a
    promotion that failed) walks again from the right end, like a fresh scan.
    """

    def __init__(self, keys: Sequence[bytes], lookup: Lookup, pin: Pin | None, size: int) -> None:
        super().__init__(keys, lookup, pin)
        self._size = size
        self._streak_after = [0] * (len(keys) + 1)  # [i]: the streak once key i is counted
        self._rightmost_defer = -1

    def start(self) -> int | None:
        return self._pass(len(self.keys) - 1, stop_at_defer=False)

    def resume(self, changed: list[bytes]) -> int | None:
        answers = self._answers
        breaks = False
        rightmost = -1
        for i in self._fired(changed):
            old = answers[i]
            if old is None:
                continue  # never asked: the pass that reaches it asks it
            new = self._ask(i)
            breaks = breaks or (_counts(old) and not _counts(new))
            rightmost = max(rightmost, i)
        if breaks:
            return self._pass(len(self.keys) - 1, stop_at_defer=False)
        if rightmost < self._rightmost_defer:
            return None  # the rightmost deferring key still defers
        return self._pass(rightmost, stop_at_defer=True)

    def _pass(self, start: int, *, stop_at_defer: bool) -> int | None:
        answers, streak_after, size = self._answers, self._streak_after, self._size
        streak = streak_after[start + 1]
        defer = False
        self._rightmost_defer = -1
        for i in range(start, -1, -1):
            result = answers[i]
            if result is None:
                result = self._ask(i)
            streak = streak + 1 if _counts(result) else 0
            streak_after[i] = streak
            if _defers(result) and not defer:
                defer = True
                self._rightmost_defer = i
                if stop_at_defer:
                    return None
            if streak == size:
                return None if defer else i + size
        return None if defer else streak
