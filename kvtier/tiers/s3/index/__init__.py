"""The S3 tier's fleet index: which keys exist under the prefix, known without a round trip.

Bytes at rest sit in ``_x_format`` modules (names and encodings, no I/O) beside the ``_x``
module that reads or writes them:

- ``_existence``: ``ExistenceIndex``, the synchronous index ``lookup()`` answers from;
- ``_keytable``: ``KeyTable``, the packed columns that hold its keys and their locations;
- ``_listing``: the listing at open;
- ``_loading``: ``IndexLoad``, the load at open run after the open, and its end for waiters;
- ``_journal_format`` / ``_journal``: the per-writer journal segments, and reading them in;
- ``_publishing``: publishing this node's segments, and deleting them once read;
- ``_rechecks``: another node's removal checked against the bucket before a key is dropped;
- ``_snapshot_format`` / ``_snapshot``: the whole index in one object, loaded at open and
  compacted into a new one; ``_snapshot_stream`` reads its body, indexed as it arrives;
  ``_snapshot_directory`` names each chunk of the body's byte range and key range, and
  ``_snapshot_sections`` fetches the chunk that holds a key the stream has not brought yet;
- ``_digest_format`` / ``_digest``: one interval's segments in one object;
- ``_audit``: the audit that lists the prefix now and then and finds what no journal said
  (objects removed behind kvtier's back, stores a killed node never published);
- ``_skew``: this node's clock against the object store's;
- ``_upkeep``: how the journal loop's helpers reach the bucket and count their requests;
- ``_sync``: ``IndexSync``, which keeps the index current from all of the above.
"""

from __future__ import annotations

from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._sync import IndexSync

__all__ = ["ExistenceIndex", "IndexSync"]
