"""The soak: a seeded, multi-process run of kvtier under faults, judged by an oracle.

``python -m benchmarks.soak`` starts a SeaweedFS and an S3 fault proxy on 127.0.0.1, then
several worker processes (``worker``), each its own ``TieringManager`` over a host pool, an
``FSTier`` and an ``S3Tier``: two share one folder, one owns its own, all share one S3 prefix
with the fleet features on. The workers run a seeded workload (``workload``) and check every
byte they load against the oracle (``oracle``); the coordinator (``coordinator``) injects
faults on the real folders (``fs_faults``), in the bucket (``s3_faults``) and on the wire
(``devtools.s3_fault_proxy``), kills workers with SIGKILL and restarts them, and the report
(``report``) adds it all up. See ``__main__`` for the command line.

The modules, one job each: ``settings`` (what a run is), ``oracle`` (what bytes a block may
hold), ``shared`` (counters and fault epochs in memory-mapped files that survive SIGKILL),
``leaks`` (threads, tasks, fds and sockets from /proc), ``workload`` (keys and the seeded op
mix), ``worker`` (one process), ``fs_faults`` and ``s3_faults`` (the faulters),
``coordinator`` (the run), ``report`` (figures, table, verdict, reproducer).
"""
