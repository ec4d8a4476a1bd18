"""A secondary tier on any S3-compatible object store, through aiobotocore (docs/design.md, "Data at
rest").

Several kvtier processes on several machines share one bucket: a prefix computed on one node
is a hit on every other. Objects live at ``<prefix>/<2 hex>/<hex key>`` (the two hex digits
spread keys over many key-name prefixes, which S3 partitions on) and hold the block format
of ``kvtier.common._format``: a header naming the key, with an xxh3 checksum of the payload that is
verified on every load. The checksum is also written to the object metadata. Stores that
reach the tier together share one *pack* object instead, and loads of blocks of one pack that
start together share one ranged GET (``_pack_format``, ``_pack``): on a small machine the
request, not the byte, is what an S3 block costs.

Choices where the contract leaves room:

- ``lookup`` answers from an existence index (``lookup_mode="index"``, the default;
  ``_existence``): this node's own writes, a listing made at open, and the keys other nodes
  publish in a small per-writer journal that this tier polls every ``index_refresh`` seconds
  (``_journal_format``, ``_sync``). A key the index does not hold is a MISS at once
  (reason ``not_found``): the request path never waits on the object store for a block that
  cannot be there. Another node's write becomes a HIT here within about ``2 x
  index_refresh`` seconds. An indexed key whose GET finds nothing is a miss that removes it.
  With ``index_digests``, one node per interval copies the interval's segments into one
  digest that the others read by name (``_digest_format``, ``_digest``), so a node's requests per
  refresh do not grow with the fleet; a missing or bad digest falls back to the journal.
  Keys a node deletes (on request, or as corrupt) go in the journal too, in removal segments
  of their own, and leave the other nodes' indexes within the same bound.
  ``lookup_mode="ask"`` keeps asking the server: it composes an ``AsyncLookupManager``
  (unknown keys answer RETRY while batched HEADs run; misses expire after ``miss_ttl``).
  ``statistics().request_path_requests`` counts the requests sent because ``lookup()``
  was asked about a key (always 0 in the index mode). With ``index_background_load`` (the
  default) the tier opens without waiting for the listing or snapshot, so a large prefix
  never holds up a manager's open: keys the load has brought answer from the index, the
  others are asked of the bucket (RETRY meanwhile) until ``statistics().index_loading`` is
  false: the chunk of the snapshot that holds the key, found through the snapshot's
  directory (``_snapshot_directory``, ``_snapshot_sections``: packed keys and keys late in
  the snapshot included), then a HEAD of the key's own object; those requests are counted
  in ``index_load_requests``. Keys found gone or deleted meanwhile are never brought back
  by the older snapshot or listing. ``await tier.wait_index_loaded()`` waits for the end of
  the load and says whether the index is complete; ``index_background_load=False`` loads
  it inside ``open()`` instead.
- A corrupt object (bad header, wrong key, wrong length, checksum mismatch) is a miss with
  reason ``corrupt`` and is **deleted**, so no node keeps paying for it and the next store
  of that key repairs it. The DELETE runs in the tier's background, bounded by
  ``read_timeout``: it never holds the load (or the promotion waiting on it) past its
  deadline. Two exceptions, skipped rather than deleted: a header of a *newer*
  format version, so a mixed-version fleet sharing a bucket never destroys the newer nodes'
  blocks; and, for a tier without an integrity key, a signed block, which it cannot check and
  which may be a signing peer's (the prefix's marker normally keeps such a tier out). A
  pack section that fails its check is a corrupt miss that drops the key from the index, and
  the pack is kept (``_blocks`` says why).
- Stores send ``If-None-Match: *``: an object that exists is not rewritten (412 means
  "already there", a success). A server that rejects the header (501 / NotImplemented) is
  remembered and gets plain puts from then on: the idempotent overwrite is harmless because
  a key always names the same bytes and S3 puts are atomic.
- Loads copy each socket chunk of the body straight into ``dst`` and check the xxh3
  checksum over what was written there, chunk by chunk (``_codec.verify_response_into``): one copy
  of the block and no worker-thread hop, so a load costs less client CPU than a raw GET and
  ``read()``. Stores build one ``bytes`` of
  header + payload (one copy of the block, one xxh3 pass, one CRC32 pass), sent as it is up
  to 1 MiB and through a ``BytesIO`` above (``_client.send_bodies_as_given``); the payload
  is not SHA-256 signed (the block carries its own checksum) and botocore adds checksums
  only where the operation requires them. Building runs on the event loop for small blocks
  and in a worker thread above a size (lower when signed), as does a signed load's MAC
  check, where the hop costs less CPU than the work (``_core``).
- Client CPU per request is what decides whether an S3 load beats recomputing the block on a
  machine with few cores: the client's configuration (``_client.client_config``) and the
  retry wrapper (``_requests``) are trimmed for it; ``benchmarks/bench_s3_cpu.py``
  measures it beside raw aiobotocore.
- Signed blocks: with ``integrity_key`` every object carries a keyed BLAKE3 MAC (see
  ``kvtier.common._format``; blocks signed with the keyed BLAKE2b of earlier releases still
  verify) and only objects that verify are served; anything else (unsigned, or
  signed with another key) is a ``corrupt`` miss and is deleted. The prefix's marker
  (``_integrity``) names the key's public fingerprint, so a node with no key or another key
  refuses the prefix at open instead of deleting its peers' blocks; a signing tier refuses a
  prefix that already holds unsigned blocks.
- Events for routers (``events``, ``kvtier.common._events``): this node's stores as ``LOCAL`` stored
  events, the blocks it held and found corrupt or gone, or deleted, as ``LOCAL`` removed
  events (``_core``); other nodes' stores and deletes, read from their journals, as
  ``REMOTE`` ones. A key this tier never held is never removed.
- Faults: botocore's own retries are off; kvtier retries transient faults (unreachable,
  timeouts, 5xx, throttling) ``max_attempts`` times with full-jitter backoff, and every
  attempt feeds a circuit breaker (``kvtier.common._resilience``). While it is open, requests
  fail at once and ``lookup`` answers MISS (reason ``unavailable``) without queueing.
- Credentials given as arguments live in a closure handed to ``create_client``, not in
  attributes; error messages are built from error codes only (``_errors``), so they
  appear in no repr, log or message. One botocore session serves every tier of a process
  (like boto3's default session): its model files are parsed once, in a worker thread.

How the package is built: ``S3Tier`` (``_tier``) is an async shell over a synchronous core,
the way httpcore's pool is a state machine with I/O outside it.

- ``_tier``: ``S3Tier``: open and close, lookup, contains_many, load, store, delete,
  statistics.
- ``_core``: the state as a state machine: index, breaker, verdicts, counters, corrupt
  deletes in flight, names; ``S3TierStatistics``.
- ``_config``: ``S3Config``, every setting defined once (name, default, check).
- ``_client``: the shared botocore session and the client's configuration.
- ``_listing_xml``: listing pages parsed in a worker thread instead of by botocore on the loop.
- ``_requests``: one request with retries, backoff and the breaker (``kvtier.common._resilience``);
  what a GET or a PUT sends.
- ``_errors``: where botocore and network errors become kvtier errors, once.
- ``_blocks``: loads and stores of block objects and pack sections, around the core.
- ``_codec``: the block format as an object (build, stream into a buffer and check).
- ``_pack_format`` (the format, no I/O), ``_pack`` (group commit of stores, coalesced reads)
  and ``_pack_table`` (a pack's table read from the bucket: at open, and before a delete).
- ``index``, the fleet index: ``_existence`` (the existence index), ``_journal_format`` (the
  format, no I/O), ``_listing`` (the listing at open) and ``_sync`` (the journal loop;
  ``_skew``, its clock check);
  ``_snapshot_format`` (the index snapshot format, no I/O) and ``_snapshot`` (writing and reading
  snapshots, so a node opens from one instead of listing the prefix; see docs/scaling.md),
  ``_snapshot_stream`` (a body indexed as it arrives), ``_snapshot_directory`` (where each
  chunk of a body starts, no I/O) and ``_snapshot_sections`` (a chunk fetched for a key
  while the body streams); ``_loading`` (when a background load ends);
  ``_journal`` (reading and applying segments, for the poll and the digests), ``_digest_format``
  (the journal digest format, no I/O) and ``_digest`` (who digests an interval, and
  reading digests).
- ``_integrity``: the prefix's integrity marker; ``_names``: names under the prefix.
"""

from __future__ import annotations

from kvtier.tiers.s3._config import S3Config
from kvtier.tiers.s3._core import S3TierStatistics
from kvtier.tiers.s3._tier import S3Tier

__all__ = ["S3Config", "S3Tier", "S3TierStatistics"]
