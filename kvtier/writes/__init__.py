"""The write path: what happens to a block after the manager has stored it in the pool.

``_writethrough`` routes each stored (or promoted) block to the secondary tiers as their
admission allows (``_admission``: latency, in-flight and rate gates per tier); ``_cascade``
writes a group of stored blocks to the set of tiers that took them, one task per group;
blocks for write-back tiers wait pinned in ``_writeback``; writes that back-pressure dropped
for a deferred tier wait as keys in ``_deferred`` and are copied later from a faster tier by
``_copydown``. What every write shares (the pool, the deadline, bytes in flight, counters)
is ``_account``; the statistics group those counters make, ``_counts``. The manager
(``kvtier.manager``) is the only caller; nothing here imports it.
"""

from __future__ import annotations

from kvtier.writes._admission import AdmissionPolicy, AdmissionStatistics

__all__ = ["AdmissionPolicy", "AdmissionStatistics"]
