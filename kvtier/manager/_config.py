"""``ManagerConfig``: every setting of the ``TieringManager``, defined once.

The ``[manager]`` section of a config file, the ``KVTIER_MANAGER_*`` variables and the
manager's keyword arguments all land here: ``TieringManager(pool, tiers, config=...,
**overrides)`` checks each keyword by its field. The section also sets up the cost model
(``kvtier.CostModel``) and write-through admission (``kvtier.AdmissionPolicy``) the manager
makes when it is not given its own; the defaults are those of the classes themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypedDict

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._settings import (
    Section,
    optional,
    parse_bool,
    parse_names,
    parse_non_negative_seconds,
    parse_positive_int,
    parse_positive_size,
    parse_rate,
    parse_seconds,
    spec,
)
from kvtier.manager._cost import CostModel
from kvtier.writes._admission import AdmissionPolicy

__all__ = ["ManagerConfig", "ManagerOverrides"]

_COST = ("recompute_seconds_per_block", "promotion_probe_interval")
_ADMISSION = (
    "max_write_latency",
    "write_probe_interval",
    "tier_max_in_flight_bytes",
    "write_back",
    "deferred",
    "max_write_rate",
)


@dataclass(frozen=True, slots=True)
class ManagerConfig(Section):
    """The ``TieringManager``'s deadlines and limits, its cost model (``kvtier.CostModel``)
    and its write-through admission (``kvtier.AdmissionPolicy``); the manager makes both
    from these settings unless it is given its own. The defaults are those of the classes
    themselves."""

    SECTION: ClassVar[str] = "manager"

    promotion_timeout: float = field(default=10.0, metadata=spec(parse_seconds))
    store_timeout: float = field(default=30.0, metadata=spec(parse_seconds))
    max_in_flight_bytes: int = field(default=256 << 20, metadata=spec(parse_positive_size))
    close_timeout: float = field(default=5.0, metadata=spec(parse_seconds))
    # How long a failed promotion keeps that tier's HIT for the key counting as a miss.
    failure_ttl: float = field(default=2.0, metadata=spec(parse_seconds))
    # The cost model: what prefilling one block costs the engine (None: unknown, and the
    # scheduler waits up to the caller's timeout), and how often a tier judged slower than
    # recompute still gets a promotion, to measure it again.
    recompute_seconds_per_block: float | None = field(
        default=None, metadata=spec(optional(parse_non_negative_seconds))
    )
    promotion_probe_interval: float = field(default=5.0, metadata=spec(parse_seconds))
    # Admission: a tier whose writes average longer than max_write_latency (None: never for
    # latency) gets no new blocks, but one probe write every write_probe_interval; a tier
    # with tier_max_in_flight_bytes being written gets none either (None: each tier's share
    # of max_in_flight_bytes). Tiers named in write_back get a block only when it leaves
    # the pool; at most write_back_limit blocks wait for that (None: a quarter of the pool).
    max_write_latency: float | None = field(default=0.25, metadata=spec(optional(parse_seconds)))
    write_probe_interval: float = field(default=1.0, metadata=spec(parse_seconds))
    tier_max_in_flight_bytes: int | None = field(
        default=None, metadata=spec(optional(parse_positive_size))
    )
    write_back: tuple[str, ...] = field(default=(), metadata=spec(parse_names))
    write_back_limit: int | None = field(default=None, metadata=spec(optional(parse_positive_int)))
    # Tiers named in deferred keep the writes back-pressure drops and get them later, copied
    # from a faster tier; max_write_rate caps what every tier is given, in bytes per second
    # (None: no cap; a write past it is dropped, or deferred for a deferred tier).
    deferred: tuple[str, ...] = field(default=(), metadata=spec(parse_names))
    max_write_rate: float | None = field(default=None, metadata=spec(optional(parse_rate)))
    # Each attempt to open a tier is bounded by open_timeout (None: no bound; keep it above
    # the index_list_timeout of an S3 tier without index_background_load). promote_write_up:
    # a block promoted from a tier is also written to the write-through tiers before it (a
    # node keeps on its disk what it read from S3).
    open_timeout: float | None = field(default=120.0, metadata=spec(optional(parse_seconds)))
    promote_write_up: bool = field(default=True, metadata=spec(parse_bool))
    # A tier that cannot open (an endpoint refused or silent, credentials refused) does not
    # stop the manager: it opens with the tiers open by then, the others are unavailable
    # (lookups skip them, writes to them are dropped) and are opened again in the background,
    # with backoff, until they join. Two waits, both counted from the tiers' local warm-up:
    # tier_answer_wait bounds how long a tier's backend may take to answer at all (an S3
    # endpoint); a tier that answered, or does not say (an FS tier), is waited for up to
    # tier_open_wait in all (an S3 tier listing a large prefix inside open, an FS tier
    # reading a large catalog), and one still opening then joins when its open ends, said in
    # the log. require_all_tiers: fail the open instead, as soon as one tier fails or passes
    # open_timeout.
    require_all_tiers: bool = field(default=False, metadata=spec(parse_bool))
    tier_answer_wait: float = field(default=1.0, metadata=spec(parse_non_negative_seconds))
    tier_open_wait: float = field(default=10.0, metadata=spec(parse_non_negative_seconds))

    def tier_in_flight_bytes(self, tiers: int, block_bytes: int) -> int:
        """Each tier's limit on bytes being written: ``tier_max_in_flight_bytes``, else its
        share of ``max_in_flight_bytes``, so one tier that falls behind cannot hold it all."""
        if self.tier_max_in_flight_bytes is not None:
            return self.tier_max_in_flight_bytes
        return max(self.max_in_flight_bytes // max(tiers, 1), block_bytes)

    def cost_model(self, given: CostModel | None) -> CostModel:
        """``given``, or the cost model these settings describe."""
        if given is None:
            return CostModel(
                recompute_seconds_per_block=self.recompute_seconds_per_block,
                probe_interval=self.promotion_probe_interval,
            )
        self._not_set(_COST, "cost", "CostModel")
        return given

    def admission_policy(
        self, given: AdmissionPolicy | None, tiers: Sequence[object], block_bytes: int
    ) -> AdmissionPolicy:
        """``given``, or the admission policy these settings describe."""
        if given is None:
            return AdmissionPolicy(
                max_in_flight_bytes=self.tier_in_flight_bytes(len(tiers), block_bytes),
                max_write_latency=self.max_write_latency,
                probe_interval=self.write_probe_interval,
                write_back=self.write_back,
                deferred=self.deferred,
                max_write_rate=self.max_write_rate,
            )
        self._not_set(_ADMISSION, "admission", "AdmissionPolicy")
        return given

    def _not_set(self, names: Sequence[str], argument: str, kind: str) -> None:
        """A policy object passed in carries its own settings: these must be left alone,
        or they would be silently ignored."""
        for name in names:
            if getattr(self, name) != self.__dataclass_fields__[name].default:
                raise InvalidArgumentError(
                    f"{name} is a setting of the {kind}; with {argument}= given, set it "
                    f"on that {kind} instead"
                )


class ManagerOverrides(TypedDict, total=False):
    """``TieringManager``'s setting keywords: the fields of ``ManagerConfig``, for type
    checkers; the values are checked by ``ManagerConfig``."""

    promotion_timeout: float
    store_timeout: float
    max_in_flight_bytes: int
    close_timeout: float
    failure_ttl: float
    recompute_seconds_per_block: float | None
    promotion_probe_interval: float
    max_write_latency: float | None
    write_probe_interval: float
    tier_max_in_flight_bytes: int | None
    write_back: Sequence[str]
    write_back_limit: int | None
    deferred: Sequence[str]
    max_write_rate: float | None
    open_timeout: float | None
    promote_write_up: bool
    require_all_tiers: bool
    tier_answer_wait: float
    tier_open_wait: float
