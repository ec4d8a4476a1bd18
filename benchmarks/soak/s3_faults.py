"""Faults in the bucket, made with a plain S3 client straight to SeaweedFS (not through kvtier
nor the proxy), each counted by kind.

- data objects (packs and single blocks): overwritten with garbage (``object_garbage``) or
  with another data object's bytes (``object_foreign``), or deleted (``object_delete``);
- the fleet's metadata, for each of the journal (stores and removals), the digests and the
  snapshots: an object corrupted (``<what>_corrupt``: bytes flipped or cut short), replayed
  (``<what>_replay``: an old object put again under a newer name, so it reads as news) or
  renamed (``<what>_rename``: copied under another name and the original deleted).
"""

from __future__ import annotations

import collections
import random
import re
import time
from typing import Any

__all__ = ["S3_FAULTS", "S3Faulter"]

S3_FAULTS: dict[str, int] = {
    "object_garbage": 10,
    "object_foreign": 10,
    "object_delete": 6,
    "journal_corrupt": 5,
    "journal_replay": 5,
    "journal_rename": 3,
    "digest_corrupt": 3,
    "digest_replay": 3,
    "digest_rename": 2,
    "snapshot_corrupt": 2,
    "snapshot_replay": 2,
    "snapshot_rename": 1,
}
_FOLDERS = {
    "object": "_kvtier_packs/",
    "journal": "_kvtier_journal/",
    "digest": "_kvtier_digests/",
    "snapshot": "_kvtier_snapshots/",
}
_STAMP = re.compile(r"(\d{15})(-[0-9a-f]{16}-)(\d{1,20})$")
_RELIST = 3.0


class S3Faulter:
    """Injects one fault at a time under ``prefix`` of ``bucket`` with ``client``."""

    def __init__(self, client: Any, bucket: str, prefix: str, seed: int) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()
        self._listed: dict[str, tuple[float, list[str]]] = {}
        self._kinds = list(S3_FAULTS)
        self._weights = [S3_FAULTS[k] for k in self._kinds]

    async def _names(self, what: str) -> list[str]:
        listed = self._listed.get(what)
        if listed is not None and time.monotonic() - listed[0] < _RELIST:
            return listed[1]
        folder = f"{self.prefix}/{_FOLDERS[what]}"
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": folder, "MaxKeys": 1000}
        if what == "object":  # pack names are hashes: start anywhere
            kwargs["StartAfter"] = folder + self.rng.randbytes(1).hex()
        page = await self.client.list_objects_v2(**kwargs)
        names = [o["Key"] for o in page.get("Contents", [])]
        if what == "object":
            single = await self.client.list_objects_v2(
                Bucket=self.bucket,
                Prefix=f"{self.prefix}/{self.rng.randbytes(1).hex()[0]}",
                MaxKeys=200,
            )
            names += [o["Key"] for o in single.get("Contents", [])]
        self._listed[what] = (time.monotonic(), names)
        return names

    async def _get(self, name: str) -> bytes:
        answer = await self.client.get_object(Bucket=self.bucket, Key=name)
        async with answer["Body"] as body:
            data: bytes = await body.read()
        return data

    async def _put(self, name: str, data: bytes) -> None:
        await self.client.put_object(Bucket=self.bucket, Key=name, Body=data)

    async def inject(self) -> str | None:
        """One fault of a seeded kind; its kind, or None when there was nothing to fault."""
        kind = self.rng.choices(self._kinds, self._weights)[0]
        what, _, action = kind.partition("_")
        names = await self._names(what)
        if not names:
            return None
        name = self.rng.choice(names)
        self._listed.pop(what, None)
        if action == "delete":
            await self.client.delete_object(Bucket=self.bucket, Key=name)
        elif action == "garbage":
            data = await self._get(name)
            await self._put(name, self.rng.randbytes(max(len(data), 1)))
        elif action == "foreign":
            other = self.rng.choice(names)
            if other == name:
                return None
            await self._put(name, await self._get(other))
        elif action == "corrupt":
            corrupt = bytearray(await self._get(name))
            if len(corrupt) > 8 and self.rng.random() < 0.5:
                del corrupt[self.rng.randrange(len(corrupt) // 2, len(corrupt)) :]
            for _ in range(1 + self.rng.randrange(4)):
                if corrupt:
                    corrupt[self.rng.randrange(len(corrupt))] ^= 1 << self.rng.randrange(8)
            await self._put(name, bytes(corrupt))
        elif action == "replay":
            newer = self._renamed(name, ahead_ms=1000 + self.rng.randrange(5000))
            await self._put(newer, await self._get(name))
        elif action == "rename":
            other = self._renamed(name, ahead_ms=self.rng.randrange(-3000, 3000))
            await self._put(other, await self._get(name))
            await self.client.delete_object(Bucket=self.bucket, Key=name)
        self.counts[kind] += 1
        return kind

    def _renamed(self, name: str, *, ahead_ms: int) -> str:
        """``name`` with its time stamp moved (journal and digest names carry one), else with
        a suffix; the result stays in the same folder."""
        match = _STAMP.search(name)
        if match is None:
            return f"{name}-{self.rng.randrange(1 << 30)}"
        stamp = max(int(time.time() * 1000) + ahead_ms, 0)
        seq = int(match.group(3)) + 1 + self.rng.randrange(1000)
        return name[: match.start()] + f"{stamp:015d}{match.group(2)}{seq}"
