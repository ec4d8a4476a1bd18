"""The keys a worker uses and the seeded choice of its next operation.

Keys are real prefix-chained keys (``kvtier.block_keys``). A chain's tokens start with one of
four "system prompts" (two blocks each), so chains share their first keys as requests do.

- **hot** chains: one small set every worker uses (namespace ``soak/hot``): the blocks the
  fleet shares through the S3 prefix and the shared folder;
- **cold** chains: a large set per worker (namespace ``soak/w<i>``), which only that worker
  stores and deletes: its *private* keys, the only ones the false-miss and durability oracles
  judge, because only for them does the worker know everything that happened to them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import kvtier
from benchmarks.soak.settings import SoakSettings

__all__ = ["OPS", "Chain", "Keys", "choose_op"]

_PROMPTS = 4
_PROMPT_BLOCKS = 2

# The op mix, by weight: lookups are the cheap, common operation.
OPS: dict[str, int] = {
    "lookup": 44,
    "lookup_run": 10,
    "scheduler_lookup": 12,
    "store": 14,
    "load": 8,
    "delete": 3,
    "prefetch": 5,
    "durable_store": 4,
    "probe": 10,
}
_NAMES = list(OPS)
_WEIGHTS = [OPS[n] for n in _NAMES]


@dataclass(frozen=True)
class Chain:
    kind: str  # "hot" or "cold"
    number: int
    keys: tuple[bytes, ...]

    @property
    def private(self) -> bool:
        return self.kind == "cold"


class Keys:
    """The chains of one worker, made on first use and kept."""

    def __init__(self, settings: SoakSettings, worker: int) -> None:
        self._settings = settings
        self._worker = worker
        self._chains: dict[tuple[str, int], Chain] = {}
        self.recent: list[int] = []  # cold chains stored lately: the working set

    def chain(self, kind: str, number: int) -> Chain:
        found = self._chains.get((kind, number))
        if found is not None:
            return found
        s = self._settings
        blocks = 1 + (number * 2654435761 + 12345) % s.max_chain_blocks
        prompt = [
            (number % _PROMPTS) * 1_000_003 + t for t in range(_PROMPT_BLOCKS * s.block_tokens)
        ]
        body = [
            (number * 7919 + t * 104_729 + 17) % 1_000_000_007
            for t in range(max(blocks - _PROMPT_BLOCKS, 0) * s.block_tokens)
        ]
        tokens = (prompt + body)[: blocks * s.block_tokens]
        space = b"soak/hot" if kind == "hot" else f"soak/w{self._worker}".encode()
        keys = kvtier.block_keys(tokens, s.block_tokens, namespace=space)
        chain = Chain(kind, number, tuple(keys))
        self._chains[kind, number] = chain
        return chain

    def pick(self, rng: random.Random) -> Chain:
        """A hot chain (skewed toward the first), a recent cold one, or any cold one."""
        s = self._settings
        roll = rng.random()
        if roll < 0.45:
            return self.chain(
                "hot", min(int(rng.expovariate(4.0 / s.hot_chains)), s.hot_chains - 1)
            )
        if roll < 0.8 and self.recent:
            return self.chain("cold", rng.choice(self.recent))
        number = rng.randrange(s.cold_chains)
        self.recent.append(number)
        if len(self.recent) > 256:
            del self.recent[: len(self.recent) - 256]
        return self.chain("cold", number)

    def pick_private(self, rng: random.Random) -> Chain:
        number = rng.choice(self.recent) if self.recent and rng.random() < 0.7 else None
        if number is None:
            number = rng.randrange(self._settings.cold_chains)
            self.recent.append(number)
        return self.chain("cold", number)


def choose_op(rng: random.Random) -> str:
    return rng.choices(_NAMES, _WEIGHTS)[0]
