"""A process that keeps an FS catalog and is killed with SIGKILL at a chosen step of its writes.

``python -m tests.tiers.fs.catalog_worker ROOT NS STEP``: opens an owner ``FSTier`` on ``ROOT``
(``fsync="never"``, a capacity of ``CAPACITY`` blocks), stores blocks 0..``FIRST``-1 of
namespace ``NS`` (``fs_worker``'s keys and bytes), writes its catalog (a checkpoint), then
stores more, loads some, deletes some, so that the log has work to do, and prints one JSON
line: the blocks it stored, deleted and that the capacity evicted (``stored``, ``deleted``,
``evicted``). Then it makes the write that ``STEP`` names and kills itself in the middle of
it:

- ``checkpoint_written``, ``checkpoint_renamed``, ``log_written``, ``log_renamed``: the
  close's checkpoint, at that step (``_catalog_files.STEPS``);
- ``log_append``: a flush of the log, half of its frame written.

The test reopens the folder and checks every block.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, NoReturn

import anyio

from kvtier.tiers.fs import FSTier, _catalog_files
from tests.tiers.fs.fs_worker import key_of, payload_of

BLOCK = 4096
FIRST = 24
MORE = 24
CAPACITY = 40


def die() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("not reached")


def kill_at(step: str) -> None:
    if step == "log_append":

        def half(fd: int, data: Any) -> int:  # os.write's signature
            data = memoryview(data)
            os.write(fd, data[: max(1, len(data) // 2)])
            die()

        _catalog_files._write = half
    else:

        def at(reached: str) -> None:
            if reached == step:
                die()

        _catalog_files._step = at


async def main(root: str, ns: str, step: str) -> None:
    tier = FSTier(root, shared=False, fsync="never", capacity_bytes=CAPACITY * (BLOCK + 4096))
    await tier.open()
    journal = tier._persistence.journal
    assert journal is not None
    evicted: set[int] = set()
    for i in range(FIRST):
        await tier.store(key_of(ns, i), memoryview(payload_of(ns, i, BLOCK)))
    await journal.flush()  # the first checkpoint
    for i in range(FIRST, FIRST + MORE):
        await tier.store(key_of(ns, i), memoryview(payload_of(ns, i, BLOCK)))
        for event in tier.events.drain():
            if event.reason == "evicted":
                evicted.update(j for j in range(i) if key_of(ns, j) in event.keys)
    dst = memoryview(bytearray(BLOCK))
    for i in range(FIRST + MORE - 1, FIRST + MORE - 6, -1):
        await tier.load(key_of(ns, i), dst)
    deleted = [FIRST + 1, FIRST + 3]
    for i in deleted:
        await tier.delete(key_of(ns, i))
    stored = [i for i in range(FIRST + MORE) if i not in evicted and i not in deleted]
    print(
        json.dumps({"stored": stored, "deleted": deleted, "evicted": sorted(evicted)}), flush=True
    )
    kill_at(step)
    if step == "log_append":
        await journal.flush()
    else:
        await tier.aclose()
    raise SystemExit("the step was never reached")


if __name__ == "__main__":
    root, ns, step = sys.argv[1:4]
    anyio.run(main, root, ns, step)
