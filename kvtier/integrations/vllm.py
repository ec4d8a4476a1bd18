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
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvtier._errors import ExtraNotInstalledError, InvalidArgumentError
from kvtier._events import EventKind
from kvtier._identity import CacheIdentity, IdentityMismatchError
from kvtier._lookup import LookupResult
from kvtier._settings import positive_int
from kvtier.integrations._bridge import BridgeStatistics, TierBridge
from kvtier.tiers._base import SecondaryTier
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._io import UnusableRootError
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
    "KVTierSecondaryTier",
    "identity_from_spec",
    "kvtier",
    "tier_from_config",
    "vllm_key_hasher",
]

logger = logging.getLogger(__name__)

KEY_PREFIX = b"\x56"  # 'V': keys derived from vLLM OffloadKeys, scheme 1
_PERSON = b"kvtier.vllm.v1"
EVENT_BUFFER = 65_536  # keys of events waiting for vLLM to take them; more are dropped
_KINDS = ("fs", "s3")
# Where the adapter's defaults differ from ``KVTierConfig``'s, and why (the measurements are in
# docs/design.md, "Measurements behind the defaults"): vLLM's own ``fs`` tier lets all 32 of its
# threads take loads, and one-block jobs arrive dozens at a time, so loads get 32 threads here
# (writers stay at 16; more did not help). And vLLM's ``fs`` tier never syncs: behind vLLM the
# FS tier keeps that durability (``fsync="never"``), with what vLLM's lacks: a kill -9 loses
# nothing stored (temporary file, then rename), and the checksum turns a block torn by a power
# loss into a miss. ``"fsync": "data"`` asks for fdatasync per block, at a cost to stores.
ADAPTER_DEFAULTS: dict[str, dict[str, Any]] = {"fs": {"max_concurrency": 32, "fsync": "never"}}
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
# looked up, the newest ``event_keys`` of them (about 100 bytes each).
EVENT_KEYS = 1 << 18
# Where a job names a chunk outside vLLM's CPU tier, the job fails with this reason.
OUT_OF_BOUNDS = "out_of_bounds"

_TO_VLLM = {
    LookupResult.HIT: VLLMLookupResult.HIT,
    LookupResult.MISS: VLLMLookupResult.MISS,
    LookupResult.RETRY: VLLMLookupResult.RETRY,
    LookupResult.HIT_PENDING: VLLMLookupResult.RETRY,  # a tier never says it; be safe
}


def tier_from_config(
    tier: Mapping[str, Any],
    *,
    num_blocks: int,
    block_bytes: int,
    identity: CacheIdentity | None = None,
) -> SecondaryTier:
    """Build the tier that ``{"kind": "fs"|"s3", ...}`` describes, with ``KVTierConfig``,
    recording and checking ``identity`` in its folder or prefix.

    The keys are those of the ``[fs]`` or ``[s3]`` section of a kvtier config file; a key
    left out takes ``KVTierConfig``'s default, except those in ``ADAPTER_DEFAULTS``.
    """
    if not isinstance(tier, Mapping):
        raise InvalidArgumentError(
            f"tier must be a mapping such as {{'kind': 'fs', 'root': '/var/cache/kvtier'}} "
            f"or a kvtier SecondaryTier, got {type(tier).__name__}"
        )
    settings = dict(tier)
    kind = settings.pop("kind", None)
    if kind not in _KINDS:
        raise InvalidArgumentError(f"tier.kind must be one of {_KINDS}, got {kind!r}")
    for name, value in ADAPTER_DEFAULTS.get(kind, {}).items():
        settings.setdefault(name, value)
    from kvtier._config import KVTierConfig

    # The pool section only satisfies KVTierConfig; the adapter builds no pool (vLLM's CPU
    # tier is the primary), but it does describe that primary truthfully.
    config = KVTierConfig.from_dict(
        {"pool": {"num_blocks": num_blocks, "block_bytes": block_bytes}, kind: settings},
        source="secondary tier 'kvtier'",
    )
    if identity is None:
        (built,) = config.build_tiers()
        return built
    key = None if config.integrity is None else config.integrity.key
    if config.fs is not None:
        return FSTier(config.fs.root, config=config.fs, integrity_key=key, identity=identity)
    assert config.s3 is not None
    return S3Tier(config.s3.bucket, config=config.s3, integrity_key=key, identity=identity)


def identity_from_spec(
    spec: object,
    block_bytes: int,
    *,
    namespace: str = "",
    extra: Mapping[str, str] | None = None,
) -> CacheIdentity:
    """The cache identity of vLLM's offloading ``spec`` (see the module doc); raises
    ``InvalidArgumentError`` when the spec does not say what the blocks are."""
    config: Any = getattr(spec, "config", None)
    try:
        groups = [[g.tokens_per_block, list(g.layer_names)] for g in config.groups]
        layout = {
            "kv_cache_layout": config.kv_cache_layout,
            "canonical": bool(config.canonical_layout),
            "replicated": bool(config.replicated_layout),
            "chunk_bytes": block_bytes,
            "groups": hashlib.blake2b(json.dumps(groups).encode(), digest_size=8).hexdigest(),
        }
        parallel = parallel_identity(config)
        cache = config.cache
        return CacheIdentity(
            model=config.model.name,
            kv_dtype=str(config.model.dtype),
            block_size=cache.tokens_per_hash * cache.blocks_per_chunk,
            layout=json.dumps(layout, sort_keys=True, separators=(",", ":")),
            parallel=parallel,
            extra={**({"namespace": namespace} if namespace else {}), **(extra or {})},
        )
    except AttributeError as exc:  # no config, or another vLLM version: refuse, never guess
        raise InvalidArgumentError(
            f"the kvtier secondary tier cannot tell what vLLM's blocks are ({exc}): pass "
            "'identity' with the model, kv_dtype, block_size, layout and parallel fields of "
            "kvtier.CacheIdentity, so blocks are never shared across a difference"
        ) from None


def parallel_identity(config: Any) -> str:
    """The ``parallel`` field of the identity, by vLLM's own sharing rules (its ``FileMapper``
    with ``parallel_agnostic``, as its fs tier builds it): bytes that are parallelism-agnostic,
    or replicated across ranks (``replicated_layout``: MLA at TP > 1, one copy per block),
    are shared by every TP, PP and CP layout, and ``"agnostic"`` says so; otherwise each
    layout and rank keeps its own blocks (TP, PP, PCP, DCP sizes and the rank). The data
    parallel rank never separates: DP replicas hold the same bytes. Whether the layout is
    replicated stays in the ``layout`` field, so replicated and head-sharded blocks, which
    vLLM keeps apart too, never meet."""
    p = config.parallel
    if p.is_parallelism_agnostic or config.replicated_layout:
        return "agnostic"
    return f"tp={p.tp_size} pp={p.pp_size} pcp={p.pcp_size} dcp={p.dcp_size} rank={p.rank}"


def _identity(
    given: CacheIdentity | Mapping[str, Any] | None,
    spec: object,
    block_bytes: int,
    namespace: str,
    extra: Mapping[str, str] | None,
) -> CacheIdentity:
    if given is None:
        return identity_from_spec(spec, block_bytes, namespace=namespace, extra=extra)
    if isinstance(given, CacheIdentity):
        return given
    if not isinstance(given, Mapping):
        raise InvalidArgumentError(
            f"identity must be a kvtier.CacheIdentity or a mapping of its fields, got {given!r}"
        )
    try:
        return CacheIdentity(**given)
    except TypeError as exc:
        raise InvalidArgumentError(f"identity: {exc}") from None


def vllm_key_hasher(identity: CacheIdentity) -> hashlib.blake2b:
    """A blake2b state holding the identity; ``copy()`` it and add an OffloadKey."""
    ns = identity.namespace
    h = hashlib.blake2b(digest_size=15, person=_PERSON)
    h.update(len(ns).to_bytes(8, "little"))
    h.update(ns)
    return h


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
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        block_bytes = self.block_size_bytes
        # One flat byte view of the primary tier; slot c is bytes [c*B, (c+1)*B).
        self._flat = primary_kv_view.cast("B")
        self._num_slots = self._flat.nbytes // block_bytes
        self.identity = _identity(identity, offloading_spec, block_bytes, namespace, identity_extra)
        if isinstance(tier, SecondaryTier):
            built = tier
            own = tier.identity if isinstance(tier, FSTier | S3Tier) else None
            if own is not None and own != self.identity:
                raise IdentityMismatchError(f"tier {tier.name!r}", self.identity.differences(own))
        else:
            built = tier_from_config(
                tier,
                num_blocks=max(1, self._num_slots),
                block_bytes=block_bytes,
                identity=self.identity,
            )
        self.namespace = namespace
        self._hasher = vllm_key_hasher(self.identity)
        # Events as vLLM's fs tier gives them: asked for here and enabled in vLLM's config.
        self.events_enabled = bool(enable_kv_events) and _kv_events_on(offloading_spec)
        if enable_kv_events and not self.events_enabled:
            logger.warning(
                "enable_kv_events is set on secondary tier '%s' but KV cache events are "
                "disabled globally; the tier will not emit events.",
                tier_type,
            )
        if not self.events_enabled and built is not tier and isinstance(built, FSTier | S3Tier):
            built.events.capacity = 0  # a tier of its own: nobody will drain its events
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


def _kv_events_on(spec: object) -> bool:
    """Whether vLLM publishes KV cache events (its global switch, as its fs tier reads it)."""
    config = getattr(spec, "kv_events_config", None)
    return bool(getattr(config, "enable_kv_cache_events", False))


# vLLM's factory resolves an out-of-tree tier as getattr(import_module(module_path), type),
# so ``"type": "kvtier"`` needs this name in the module.
kvtier = KVTierSecondaryTier
