"""kvtier's tiers as a vLLM secondary KV offload tier (vLLM's ``TieringOffloadingManager``).

Put this in the tiering spec's ``secondary_tiers`` (``kv_connector_extra_config``); vLLM's
``SecondaryTierFactory`` imports ``module_path`` and takes the class named by ``type``::

    {"type": "kvtier", "module_path": "kvtier.integrations.vllm",
     "namespace": "llama-3-8b",
     "tier": {"kind": "fs", "root": "/var/cache/kvtier"}}

``tier`` takes the keys of one section of ``KVTierConfig`` (``kvtier.FSConfig`` for
``"kind": "fs"``, ``kvtier.S3Config`` for ``"kind": "s3"``), validated by the same code, so a
mistake names the key (``fs.root``); two defaults differ (``ADAPTER_DEFAULTS``): the FS tier
reads with 32 threads and does not fsync, as vLLM's own ``fs`` tier. From Python, ``tier``
may also be a ready ``kvtier.SecondaryTier`` (a tier of your own). Other keys:
``namespace`` (text mixed into every key, see below), ``identity`` and ``identity_extra``
(below), ``miss_ttl``, ``op_timeout``,
``check_timeout`` (seconds; see ``TierBridge``), ``enable_kv_events`` and ``event_keys``
(below) and vLLM's own ``locality`` and ``backpressure``.

How vLLM's calls map onto kvtier (all of them return at once; see ``_bridge`` for the thread):

- ``lookup``: a verdict the tier has given (``HIT``/``MISS``), or ``RETRY`` while the tier's
  existence check runs; a fault in the tier is a ``MISS`` with a reason, never an exception in
  vLLM's scheduler. Answers and reasons are counted (``statistics()``).
- ``submit_store`` / ``submit_load``: each key is stored from, or loaded into, its primary
  slot ``primary_kv_view[chunk_id]``; a job is one pinned batch call on the tier
  (``store_many``/``load_many``: vLLM keeps the slots until the job is reported, and
  ``drain_jobs`` waits), so FSTier needs no private copy beyond what O_DIRECT asks for, and
  jobs submitted together share a call. kvtier's block format and checksum apply. A load
  where some keys fail reports ``successful_keys``; a failed key's verdict becomes a miss
  so vLLM does not promote it again at once. ``op_timeout`` bounds each job from its
  submission, a tier still opening included: blocks not started by then fail (``timeout``);
  a block under way is waited for. ``check_timeout`` bounds a lookup's ``RETRY`` the same way.
- A job that cannot run (a chunk id outside vLLM's CPU tier, or any error starting it) is a
  failed job (``out_of_bounds``), as vLLM's own tiers report it: nothing raises into vLLM's
  scheduler, and nothing of the job is kept.
- ``take_events``: with ``enable_kv_events`` and vLLM's KV events both on (as vLLM's ``fs``
  tier), one stored ``OffloadingEvent`` per store job that landed whole, with its keys, and
  removed events for blocks the tier evicted, deleted as corrupt or found gone, in the order
  they happened, and REMOTE stored events for blocks another node stored (a shared S3 tier).
  Events name vLLM's keys through the newest ``event_keys`` keys stored or looked up here.
- A root that cannot be created or written raises ``UnusableRootError`` (an ``OSError``)
  from the constructor, as vLLM's ``fs`` tier raises; a hung mount is not waited for beyond
  ``check_timeout``.
- ``drain_jobs`` blocks until no job touches the primary view (jobs are waited for, never
  cancelled); ``shutdown`` drains, closes the tier and joins the loop thread.

Identity and keys: the adapter builds a ``kvtier.CacheIdentity`` from vLLM's offloading spec:
the model, the KV dtype, the tokens per chunk (tokens per hash x blocks per chunk), the layout
(vLLM's KV cache layout, canonical and replicated flags, the chunk's bytes and a digest of the
KV cache groups), the parallel layout by vLLM's sharing rules (``parallel_identity``) and, as
``extra`` fields, ``namespace`` and whatever ``identity_extra`` adds (vLLM's spec does not carry
the RoPE settings: name them there, or as ``positional`` in a full ``identity``). ``identity``
(a ``CacheIdentity``, or a mapping of its fields) replaces what the spec gives. Where neither
gives one the adapter refuses to start: a cache whose identity nobody states can hand one engine
another engine's bytes. The tier it builds records the identity in its folder or prefix and
refuses one that records another (or, with ``separate_identities`` in ``tier``, keeps each
identity apart); a tier that refuses answers misses, and the log says which fields differ.

A vLLM ``OffloadKey`` (block hash plus group index) becomes the kvtier key
``0x56 || blake2b-120(identity, key)``. It depends only on the key and the identity, so two
vLLM instances of one identity share blocks in one folder or bucket, and instances of two
never share a key. The leading ``0x56`` ('V') keeps these keys apart from
``kvtier.block_keys`` keys.
"""

# vLLM is an optional extra: where it is missing (the usual typecheck session) its names are
# Any, and the adapter subclasses one of them.
# mypy: allow-subclassing-any

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvtier.common._arguments import positive_int
from kvtier.common._errors import ExtraNotInstalledError, InvalidArgumentError
from kvtier.common._events import EventKind
from kvtier.common._identity import CacheIdentity, IdentityMismatchError
from kvtier.common._lookup import LookupResult
from kvtier.integrations._vllm_setup import (
    ADAPTER_DEFAULTS,
    identity_from_spec,
    identity_of,
    tier_from_config,
    vllm_key_hasher,
)
from kvtier.integrations.bridge._bridge import BridgeStatistics, TierBridge
from kvtier.tiers._base import SecondaryTier
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._root import UnusableRootError
from kvtier.tiers.s3 import S3Tier

try:
    from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found, unused-ignore]
        Locality,
        Medium,
        OffloadingEvent,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found, unused-ignore]
        LookupResult as VLLMLookupResult,
    )
    from vllm.v1.kv_offload.tiering.base import (  # type: ignore[import-not-found, unused-ignore]
        JobResult,
        SecondaryTierManager,
        TransferJob,
    )
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ExtraNotInstalledError(
        "kvtier.integrations.vllm", "vllm", "vllm.v1.kv_offload.tiering"
    ) from exc

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found, unused-ignore]
        OffloadingSpec,
    )
    from vllm.v1.kv_offload.tiering.backpressure import (  # type: ignore[import-not-found, unused-ignore]
        BackpressureDetector,
    )

__all__ = [
    "ADAPTER_DEFAULTS",
    "KVTierSecondaryTier",
    "identity_from_spec",
    "kvtier",
    "tier_from_config",
    "vllm_key_hasher",
]

logger = logging.getLogger(__name__)

KEY_PREFIX = b"\x56"  # 'V': keys derived from vLLM OffloadKeys, scheme 1
EVENT_BUFFER = 65_536  # keys of events waiting for vLLM to take them; more are dropped
_OPTIONS = (
    "namespace",
    "identity",
    "identity_extra",
    "miss_ttl",
    "op_timeout",
    "check_timeout",
    "locality",
    "enable_kv_events",
    "event_keys",
    "tier",
)
# Events name vLLM's keys; a kvtier key maps back through the keys this instance stored or
# looked up, the newest ``event_keys`` of them (their memory: docs/design.md, "Measurements
# behind the defaults").
EVENT_KEYS = 1 << 18
# Where a job names a chunk outside vLLM's CPU tier, the job fails with this reason.
OUT_OF_BOUNDS = "out_of_bounds"

_TO_VLLM = {
    LookupResult.HIT: VLLMLookupResult.HIT,
    LookupResult.MISS: VLLMLookupResult.MISS,
    LookupResult.RETRY: VLLMLookupResult.RETRY,
    LookupResult.HIT_PENDING: VLLMLookupResult.RETRY,  # a tier never says it; be safe
}


class KVTierSecondaryTier(SecondaryTierManager):
    """A vLLM ``SecondaryTierManager`` over one kvtier ``SecondaryTier``; see the module doc."""

    medium: ClassVar[Medium | None] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        tier: Mapping[str, Any] | SecondaryTier | None = None,
        namespace: str = "",
        identity: CacheIdentity | Mapping[str, Any] | None = None,
        identity_extra: Mapping[str, str] | None = None,
        miss_ttl: float = 2.0,
        op_timeout: float = 60.0,
        check_timeout: float = 10.0,
        locality: str | None = None,
        enable_kv_events: bool = False,
        event_keys: int = EVENT_KEYS,
        **unknown: Any,
    ) -> None:
        tier = _checked(unknown, tier, namespace)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        block_bytes = self.block_size_bytes
        # One flat byte view of the primary tier; slot c is bytes [c*B, (c+1)*B).
        self._flat = primary_kv_view.cast("B")
        self._num_slots = self._flat.nbytes // block_bytes
        self.identity = identity_of(
            identity, offloading_spec, block_bytes, namespace, identity_extra
        )
        built = self._tier_of(tier)
        self.namespace = namespace
        self._hasher = vllm_key_hasher(self.identity)
        self._set_up_events(built, built is not tier, enable_kv_events, offloading_spec)
        self._event_keys = positive_int(event_keys, "event_keys")
        # kvtier key -> vLLM key of the newest stores, so events can name vLLM's keys.
        self._vllm_keys: OrderedDict[bytes, OffloadKey] = OrderedDict()
        # Keys looked up are remembered too where another node's blocks can be reported
        # (REMOTE): not for an FS tier, which reports only its own.
        self._remember_lookups = self.events_enabled and not isinstance(built, FSTier)
        self.events_unmapped = 0  # keys of tier events that no store here had named
        self._bridge = TierBridge(
            built,
            name=tier_type,
            miss_ttl=miss_ttl,
            op_timeout=op_timeout,
            check_timeout=check_timeout,
            events=EVENT_BUFFER if self.events_enabled else 0,
        )
        # Keys of running jobs, so a result can name vLLM's keys (successful_keys).
        self._job_keys: dict[int, list[OffloadKey]] = {}
        if isinstance(built, FSTier):
            # A root that cannot be created or written is a configuration error: raise it
            # here, as vLLM's own fs tier does (a hung mount is waited for no longer).
            error = self._bridge.wait_open(check_timeout)
            if isinstance(error, UnusableRootError):
                self._bridge.close()
                raise error

    def _tier_of(self, tier: Mapping[str, Any] | SecondaryTier) -> SecondaryTier:
        """The tier ``tier`` names, built under this adapter's identity; a ready tier that
        records another identity is refused."""
        if isinstance(tier, SecondaryTier):
            own = tier.identity if isinstance(tier, FSTier | S3Tier) else None
            if own is not None and own != self.identity:
                raise IdentityMismatchError(f"tier {tier.name!r}", self.identity.differences(own))
            return tier
        return tier_from_config(
            tier,
            num_blocks=max(1, self._num_slots),
            block_bytes=self.block_size_bytes,
            identity=self.identity,
        )

    def _set_up_events(
        self, built: SecondaryTier, own_tier: bool, asked: bool, spec: OffloadingSpec
    ) -> None:
        """Events as vLLM's fs tier gives them: asked for here and enabled in vLLM's config;
        a tier of the adapter's own that nobody drains keeps none."""
        self.events_enabled = bool(asked) and _kv_events_on(spec)
        if asked and not self.events_enabled:
            logger.warning(
                "enable_kv_events is set on secondary tier '%s' but KV cache events are "
                "disabled globally; the tier will not emit events.",
                self.tier_type,
            )
        if not self.events_enabled and own_tier and isinstance(built, FSTier | S3Tier):
            built.events.capacity = 0

    # -- keys and slots -------------------------------------------------------------------------

    def kvtier_key(self, key: OffloadKey | bytes) -> bytes:
        """The kvtier key that stores vLLM's ``key`` (deterministic; see the module doc)."""
        h = self._hasher.copy()
        h.update(bytes(key))
        return KEY_PREFIX + h.digest()

    def _slots(self, chunk_ids: Iterable[Any]) -> list[memoryview] | None:
        """The primary's slots for ``chunk_ids``; None when one is outside it."""
        size, flat, slots = self.block_size_bytes, self._flat, self._num_slots
        views = []
        for c in chunk_ids:
            slot = int(c)
            if not 0 <= slot < slots:
                return None
            views.append(flat[slot * size : (slot + 1) * size])
        return views

    # -- SecondaryTierManager -----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> VLLMLookupResult:
        hashed = self.kvtier_key(key)
        if self._remember_lookups:  # another node may store it: its REMOTE event names it
            self._remember((hashed,), (key,))
        return _TO_VLLM[self._bridge.lookup(hashed)]

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, "store")

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, "load")

    def _submit(self, job: TransferJob, operation: Any) -> None:
        """Start a job; whatever is wrong with it fails the job (as vLLM's tiers report it),
        never raises into vLLM's scheduler."""
        keys = list(job.keys)
        self._job_keys[job.job_id] = keys
        try:
            views = self._slots(job.chunk_ids)
            if views is None or len(views) != len(keys):
                logger.warning(
                    "%s: job %s names chunks %s outside the primary tier's %d (or not one per "
                    "key): failed",
                    self.tier_type,
                    job.job_id,
                    list(job.chunk_ids),
                    self._num_slots,
                )
                self._bridge.reject(job.job_id, operation, len(keys), OUT_OF_BOUNDS)
                return
            hashed = [self.kvtier_key(k) for k in keys]
            if self.events_enabled and operation == "store":
                self._remember(hashed, keys)
            self._bridge.submit(job.job_id, operation, hashed, views)
        except Exception:  # a bug of ours must not take vLLM's scheduler down
            logger.exception("%s: job %s could not start; failed", self.tier_type, job.job_id)
            self._bridge.reject(job.job_id, operation, len(keys), "tier_error")

    def _remember(self, hashed: Sequence[bytes], keys: Sequence[OffloadKey]) -> None:
        known = self._vllm_keys
        for h, k in zip(hashed, keys, strict=True):
            known[h] = k
            known.move_to_end(h)  # the newest last: the oldest go first
        while len(known) > self._event_keys:
            known.popitem(last=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for outcome in self._bridge.take_finished():
            keys = self._job_keys.pop(outcome.job_id, [])
            successful = None
            if not outcome.success and outcome.done and outcome.operation == "load":
                successful = tuple(keys[i] for i in outcome.done)
            results.append(
                JobResult(
                    job_id=outcome.job_id,
                    success=outcome.success,
                    successful_keys=successful,
                    transfer_time=outcome.seconds,
                    transfer_bytes=outcome.nbytes,
                )
            )
        return results

    def has_pending_work(self) -> bool:
        return self._bridge.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What this tier stored and removed since the last call, as vLLM's fs tier reports
        it: one stored event per store job that landed whole, with its keys; and, beyond
        vLLM's, removed events (evicted for capacity, deleted as corrupt, found gone) and
        blocks learnt from another node (REMOTE), for keys this instance stored or looked up."""
        if not self.events_enabled:
            return []
        events = []
        for event in self._bridge.take_events():
            keys = []
            for h in event.keys:
                k = self._vllm_keys.get(h)
                if k is None:
                    self.events_unmapped += 1
                else:
                    keys.append(k)
            if keys:  # vLLM's events name blocks: a CLEARED event has none
                local = event.locality == "LOCAL"
                events.append(
                    OffloadingEvent(
                        keys=keys,
                        medium=self.medium,
                        removed=event.kind is not EventKind.STORED,
                        locality=self.locality if local else Locality.REMOTE,
                        ownership=self.tier_type,
                        # this tier reports its removals: vLLM keeps a block's event
                        # metadata until the removal names it
                        removal_expected=True,
                    )
                )
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return

    def drain_jobs(self) -> None:
        self._bridge.drain()

    def shutdown(self) -> None:
        self._bridge.close()
        with contextlib.suppress(BufferError):  # vLLM closes the primary's mmap next
            self._flat.release()

    # -- kvtier extras ------------------------------------------------------------------------

    @property
    def bridge(self) -> TierBridge:
        """The loop thread and snapshot behind this tier (for tools and tests)."""
        return self._bridge

    def statistics(self) -> BridgeStatistics:
        """Lookup answers by result and miss reason, jobs, and the kvtier tier's own counters."""
        return self._bridge.statistics()

    def __repr__(self) -> str:
        return (
            f"<KVTierSecondaryTier {self.tier_type!r} namespace={self.namespace!r} "
            f"{self._bridge!r}>"
        )


def _checked(
    unknown: Mapping[str, Any], tier: Mapping[str, Any] | SecondaryTier | None, namespace: object
) -> Mapping[str, Any] | SecondaryTier:
    """The adapter's settings, checked where vLLM's config file can get them wrong."""
    if unknown:
        raise InvalidArgumentError(
            f"unknown setting(s) {sorted(unknown)} for the kvtier secondary tier; "
            f"it takes {list(_OPTIONS)} (and vLLM's 'backpressure')"
        )
    if tier is None:
        raise InvalidArgumentError(
            "the kvtier secondary tier needs 'tier', such as "
            "{'kind': 'fs', 'root': '/var/cache/kvtier'}"
        )
    if not isinstance(namespace, str):
        raise InvalidArgumentError(f"namespace must be a string, got {namespace!r}")
    return tier


def _kv_events_on(spec: object) -> bool:
    """Whether vLLM publishes KV cache events (its global switch, as its fs tier reads it)."""
    config = getattr(spec, "kv_events_config", None)
    return bool(getattr(config, "enable_kv_cache_events", False))


# vLLM's factory resolves an out-of-tree tier as getattr(import_module(module_path), type),
# so ``"type": "kvtier"`` needs this name in the module.
kvtier = KVTierSecondaryTier
