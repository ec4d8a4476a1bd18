"""The bridge's existence answers: a snapshot engine threads read, kept by the loop thread.

``lookup`` reads the snapshot under the shared lock and never waits: a verdict gives ``HIT`` or
``MISS`` (with its reason); an unknown key is queued for the loop thread, which asks the tier's
own ``lookup_with_reason()`` (where its batched, coalesced existence checks live, and which
says why a miss is one) and answers ``RETRY`` until the verdict lands. So the tier is only ever
touched from its loop thread, as kvtier's tiers expect.

Staleness: a miss verdict expires after ``miss_ttl`` (another node may write the key to a
shared tier); a hit stays until the tier says the key changed (its change notification drops
the verdict), a load of it fails, or the snapshot's bound pushes it out. A check's deadline
runs from when the key was first asked (``check_timeout``), while the tier opens too: then the
key is a ``timeout`` miss, so lookups stop answering ``RETRY`` whether or not the tier opens.

The verdicts are a ``VerdictStore`` (a packed int per key, nothing per key for the garbage
collector). A miss's code names its reason: ``MissReason``'s codes first, then the bridge's
own, then any other name a tier gives, numbered when first seen.
"""

from __future__ import annotations

import asyncio
import math
import time

from kvtier.common._lookup import HIT, MISS, RETRY, LookupResult, MissReason
from kvtier.common._verdicts import MAX_CODE, PRESENT, VerdictStore
from kvtier.integrations.bridge._shared import ACCEPTING, CLOSED, OVERLOAD, TIER_ERROR, Shared

__all__ = ["LookupSnapshot"]

TIMEOUT = MissReason.TIMEOUT.value


class LookupSnapshot:
    """Verdicts and existence checks: ``lookup`` for engine threads (under ``shared.lock``),
    the rest for the loop thread."""

    def __init__(
        self,
        shared: Shared,
        *,
        miss_ttl: float,
        check_timeout: float,
        max_verdicts: int,
        max_checks: int,
    ) -> None:
        self._shared = shared
        self._miss_ttl = miss_ttl
        self._check_timeout = check_timeout
        self._max_checks = max_checks
        # -- under shared.lock ----------------------------------------------------------------
        self._verdicts = VerdictStore(max_verdicts)  # codes: _reason_names
        # Unknown keys the loop has yet to ask about, with the time.monotonic() they were
        # first asked (their check's deadline runs from it), and the keys it has asked about.
        self._asking: dict[bytes, float] = {}
        self._checking: set[bytes] = set()
        self._flush_scheduled = False
        self.hits = self.misses = self.retries = 0
        self.miss_reasons: dict[str, int] = {}
        self._reason_names: list[str] = ["", *(reason.value for reason in MissReason)]
        self._reason_codes = {name: code for code, name in enumerate(self._reason_names) if code}
        for name in (CLOSED, OVERLOAD, TIER_ERROR):
            self._code(name)
        # -- loop thread only -----------------------------------------------------------------
        # Keys checked but without a verdict yet (the tier answered RETRY, or it is still
        # opening), each with the timer that ends its wait at its check deadline.
        self._waiting: dict[bytes, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        """Verdicts held (under the lock)."""
        return len(self._verdicts)

    @property
    def checks(self) -> int:
        """Existence checks asked and not answered yet (under the lock)."""
        return len(self._asking) + len(self._checking)

    # -- engine threads ---------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        """``HIT``, ``MISS`` or ``RETRY`` from the snapshot, without waiting."""
        schedule = False
        with self._shared.lock:
            if self._shared.state not in ACCEPTING:
                return self._count_miss(CLOSED)  # a closed tier can no longer load a hit
            code = self._verdicts.get(key)
            if code is not None:
                if code == PRESENT:
                    self.hits += 1
                    return HIT
                return self._count_miss(self._reason_names[code])
            if key not in self._asking and key not in self._checking:
                if len(self._asking) + len(self._checking) >= self._max_checks:
                    self._shared.log.warning(
                        "overload", "%s: too many existence checks", self._shared.name
                    )
                    return self._count_miss(OVERLOAD)
                self._asking[key] = time.monotonic()
                if not self._flush_scheduled:
                    self._flush_scheduled = schedule = True
            self.retries += 1
        if schedule and not self._shared.thread.call_soon(self.flush):
            with self._shared.lock:
                self._asking.pop(key, None)
                return self._count_miss(CLOSED)
        return RETRY

    def stop_asking(self) -> None:
        """The bridge is closing (under the lock): drop the keys not asked about yet."""
        self._asking.clear()

    # -- the loop thread --------------------------------------------------------------------

    def flush(self) -> None:
        """Ask the tier about every queued key; while it opens, start each key's check
        deadline and ask once it has opened (see ``opened``)."""
        with self._shared.lock:
            asked = list(self._asking.items())
            self._asking.clear()
            self._flush_scheduled = False
            self._checking.update(key for key, _ in asked)
            state = self._shared.state
        for key, since in asked:
            if state == "open":
                self._ask(key, since)
            elif state == "opening":
                self._wait(key, since)
            else:
                self.verdict(key, False, CLOSED)

    def opened(self, state: str) -> None:
        """The tier's open ended in ``state``: ask about the keys asked while it opened
        (their deadlines kept), or answer them as closed."""
        for key in list(self._waiting):
            if state == "open":
                self._ask(key)
            else:
                self.verdict(key, False, CLOSED)
        self.flush()

    def on_tier_change(self, key: bytes) -> None:
        """The tier says ``key``'s answer may have changed."""
        if key in self._waiting:
            self._ask(key)  # still RETRY: the wait goes on to its first deadline
            return
        with self._shared.changed:
            if self._verdicts.forget(key):
                self._shared.landed()

    def verdict(self, key: bytes, present: bool, reason: str) -> None:
        """Publish ``key``'s verdict: present, or a miss for ``reason``."""
        timer = self._waiting.pop(key, None)
        if timer is not None:
            timer.cancel()
        with self._shared.changed:
            self._checking.discard(key)
            if present:
                self._verdicts.set(key, PRESENT, math.inf)
            else:
                self._verdicts.set(key, self._code(reason), self._miss_ttl)
            self._shared.landed()

    def _wait(self, key: bytes, since: float) -> None:
        """Wait for a verdict on ``key`` until ``check_timeout`` after ``since``; a tier that
        forgets to notify is asked once more then, and after that the key is a miss."""
        if key not in self._waiting:
            delay = max(0.0, since + self._check_timeout - time.monotonic())
            self._waiting[key] = self._shared.thread.call_later(delay, self._check_expired, key)

    def _ask(self, key: bytes, since: float | None = None, *, final: bool = False) -> None:
        try:
            result, reason = self._shared.tier.lookup_with_reason(key)
        except Exception as exc:  # a malformed answer too: a tier bug, contained
            self._shared.log.warning("lookup", "%s: tier lookup raised: %r", self._shared.name, exc)
            self.verdict(key, False, TIER_ERROR)
            return
        if result is RETRY and final:
            self.verdict(key, False, TIMEOUT)
        elif result is RETRY:
            # The tier notifies when its check lands (see on_tier_change).
            self._wait(key, time.monotonic() if since is None else since)
        elif result is HIT:
            self.verdict(key, True, "")
        else:
            self.verdict(key, False, str(reason or MissReason.NOT_FOUND))

    def _check_expired(self, key: bytes) -> None:
        if self._waiting.pop(key, None) is None:
            return
        if self._shared.state == "opening":  # the tier has not opened within the deadline
            self.verdict(key, False, TIMEOUT)
        else:
            self._ask(key, final=True)

    # -- helpers ----------------------------------------------------------------------------

    def _code(self, reason: str) -> int:
        """The verdict code of a miss for ``reason`` (under the lock); a new name gets the next
        code while there is one, then counts as ``not_found`` (codes are a few bits of an int)."""
        code = self._reason_codes.get(reason)
        if code is None:
            if len(self._reason_names) > MAX_CODE:
                self._shared.log.warning(
                    "reasons", "%s: too many miss reasons: %r", self._shared.name, reason
                )
                return self._reason_codes[MissReason.NOT_FOUND.value]
            code = self._reason_codes[reason] = len(self._reason_names)
            self._reason_names.append(reason)
        return code

    def _count_miss(self, reason: str) -> LookupResult:
        self.misses += 1
        self.miss_reasons[reason] = self.miss_reasons.get(reason, 0) + 1
        return MISS
