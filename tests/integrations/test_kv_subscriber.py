"""A router's view from kvtier's events: the full state, sequence repair, shared tiers.

The sequence tracker and the view are state machines tested without sockets; the subscriber
and the publisher's full state run over real ZMQ sockets on 127.0.0.1 with a real FS tier."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from kvtier import EventBuffer, EventKind, EventStream, FSTier
from kvtier.integrations._full_state import full_state
from kvtier.integrations.kv_events import KVEventPublisher
from kvtier.integrations.kv_subscriber import (
    KVEventSubscriber,
    ResidencyView,
    SequenceTracker,
    WireEvent,
    decode_events,
    tier_class,
)
from tests.integrations.test_kv_events import RECEIVE_MS, joined, subscriber
from tests.support import fresh_keys

ANY_PORT = "tcp://127.0.0.1:0"
BLOCK = 4096
CLEARED = WireEvent("AllBlocksCleared")


def stored(*keys: bytes, tier: str = "fs", shared: bool = False) -> WireEvent:
    return WireEvent("BlockStored", keys, tier, "STORAGE", shared, "object" if shared else "disk")


def removed(*keys: bytes, tier: str = "fs", shared: bool = False) -> WireEvent:
    return WireEvent("BlockRemoved", keys, tier, "STORAGE", shared, "object" if shared else "disk")


# -- the sequence tracker ------------------------------------------------------------------------


def synced(tracker: SequenceTracker, at: int = 0) -> None:
    assert tracker.live(at, [CLEARED]) == [[CLEARED]]
    assert tracker.in_sync and tracker.want is None


def test_a_subscriber_that_joins_asks_for_the_full_state_and_holds_news_for_after_it() -> None:
    tracker = SequenceTracker()
    assert tracker.asked() == "full" and not tracker.in_sync
    news = [stored(b"k")]
    assert tracker.live(7, news) == [news]  # applied now, held to apply again after the reset
    state = [[CLEARED, stored(b"a")]]
    assert tracker.full_state(7, state) == [*state, news]
    assert tracker.in_sync and tracker.next == 8 and tracker.want is None


def test_a_gap_is_held_and_repaired_by_replay_in_order() -> None:
    tracker = SequenceTracker()
    synced(tracker)
    a, b, c = [stored(b"a")], [stored(b"b")], [stored(b"c")]
    assert tracker.live(3, c) == []
    assert tracker.want == "replay" and tracker.stats.missed == 2
    assert tracker.replayed(1, a) == [a]
    assert tracker.replayed(2, b) == [b, c]  # the held batch follows without a gap
    assert tracker.in_sync and tracker.want is None and tracker.next == 4


def test_a_replay_that_cannot_close_the_gap_asks_for_the_full_state() -> None:
    tracker = SequenceTracker()
    synced(tracker)
    later = [stored(b"z")]
    tracker.live(50, later)
    tracker.replay_ended()  # the publisher no longer held 1..49
    assert tracker.asked() == "full"
    assert tracker.full_state(50, [[CLEARED]]) == [[CLEARED], later]
    assert tracker.in_sync and tracker.next == 51


def test_a_restarted_publisher_is_followed_from_its_announced_reset() -> None:
    tracker = SequenceTracker()
    synced(tracker, at=100)
    tracker.live(101, [stored(b"a")])
    assert tracker.live(0, [CLEARED, stored(b"b")]) == [[CLEARED, stored(b"b")]]
    assert tracker.next == 1 and tracker.stats.restarts == 1 and tracker.in_sync


def test_a_kvtier_publisher_restarted_jumps_ahead_counted_as_a_restart_not_as_missed() -> None:
    tracker = SequenceTracker()
    synced(tracker, at=1_700_000_000_000_000)  # numbered from its start's microseconds
    restarted = 1_700_000_005_000_000  # started again five seconds later
    assert tracker.live(restarted, [stored(b"a")]) == []
    assert tracker.stats.restarts == 1 and tracker.stats.missed == 0
    assert tracker.asked() in ("replay", "full")
    assert tracker.full_state(restarted + 1, [[CLEARED]]) == [[CLEARED]]
    assert tracker.in_sync and tracker.next == restarted + 1


def test_a_restart_without_its_reset_asks_for_the_full_state() -> None:
    tracker = SequenceTracker()
    synced(tracker, at=100)
    tracker.live(3, [stored(b"a")])
    assert tracker.want == "full" and not tracker.in_sync


def test_a_heartbeat_after_a_lost_tail_opens_the_gap_a_replay_closes() -> None:
    """The last batch of a burst was lost: nothing showed it until the publisher's next
    message, an empty batch with the next sequence."""
    tracker = SequenceTracker()
    synced(tracker)
    assert tracker.live(2, []) == []  # batch 1 never came
    assert tracker.want == "replay" and tracker.stats.missed == 1
    lost = [stored(b"tail")]
    assert tracker.replayed(1, lost) == [lost, []]
    assert tracker.in_sync and tracker.next == 3


def test_a_live_batch_a_full_state_reply_overtook_is_dropped_not_taken_for_a_restart() -> None:
    """The reply comes on the replay socket and can arrive before live batches sent ahead
    of it: those are in the state already, and the publisher did not restart."""
    tracker = SequenceTracker()
    assert tracker.live(3, [stored(b"a")]) == [[stored(b"a")]]
    state = [[CLEARED, stored(b"a"), stored(b"b")]]
    assert tracker.full_state(6, state) == state  # covers batches 4 and 5, still in flight
    assert tracker.live(4, [stored(b"b")]) == [] and tracker.live(5, [removed(b"z")]) == []
    assert tracker.stats.stale == 2 and tracker.stats.restarts == 0
    assert tracker.in_sync and tracker.want is None
    assert tracker.live(6, [stored(b"c")]) == [[stored(b"c")]]


def test_a_full_state_reply_that_does_not_start_with_a_reset_is_not_taken() -> None:
    tracker = SequenceTracker()
    assert tracker.full_state(4, [[stored(b"a")]]) == []
    assert tracker.next is None and tracker.want == "full"


# -- the view ------------------------------------------------------------------------------------


def test_a_shared_tier_is_kept_once_and_credited_to_every_node_that_reaches_it() -> None:
    view = ResidencyView(3)
    view.apply(0, [stored(b"k", tier="s3", shared=True)])
    view.apply(1, [stored(b"j", tier="s3", shared=True)])  # node 1 reaches it too
    assert view.tiers_holding(1, b"k") == ["s3"]  # stored by node 0, loadable by node 1
    assert view.tiers_holding(2, b"k") == []  # node 2 never said it reaches the tier
    assert view.shared("s3") == {b"k", b"j"} and view.classes["s3"] == "object_store"
    view.apply(1, [removed(b"k", tier="s3", shared=True)])  # any node's removal: gone for all
    assert view.tiers_holding(0, b"k") == []


def test_a_node_reset_takes_only_its_own_word_off_shared_blocks() -> None:
    view = ResidencyView(2)
    view.apply(0, [stored(b"both", b"only0", tier="s3", shared=True), stored(b"f")])
    view.apply(1, [stored(b"both", tier="s3", shared=True)])
    view.apply(0, [CLEARED])
    assert view.shared("s3") == {b"both"}  # node 1 still vouches for it
    assert view.believed(0, "fs") == set()
    assert view.tiers_holding(0, b"both") == ["s3"]  # node 0 still reaches the tier


def test_private_tiers_are_per_node_and_classed_by_medium_storage_and_sharing() -> None:
    view = ResidencyView(2)
    view.apply(0, [stored(b"a")])
    assert view.tiers_holding(0, b"a") == ["fs"] and view.tiers_holding(1, b"a") == []
    assert [tier_class(*c) for c in (("GPU", "", False), ("CPU", "", False))] == ["gpu", "host"]
    assert tier_class("STORAGE", "disk", True) == "shared_storage"
    assert tier_class("STORAGE", "disk", False) == "disk"


@pytest.mark.parametrize(
    "body",
    [
        None,
        [1.0],
        [1.0, "events"],
        [1.0, [{"type": "Nope"}]],
        [1.0, [{"type": "BlockStored", "block_hashes": ["str"]}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [], "shared": "yes"}]],
        [1.0, [3]],
    ],
)
def test_what_is_not_a_kv_event_batch_is_refused(body: object) -> None:
    with pytest.raises(ValueError):  # MalformedBatchError
        decode_events(body)


# -- the full state ------------------------------------------------------------------------------


class Holder:
    def __init__(self, name: str, keys: list[bytes], *, shared: bool = False) -> None:
        self.events = EventBuffer(name, shared=shared, storage="object" if shared else "disk")
        self._keys = keys

    def held_keys(self) -> list[bytes]:
        return list(self._keys)

    def held_keys_reader(self) -> Callable[[], list[bytes]]:
        keys = list(self._keys)
        return lambda: keys


def test_a_full_state_is_a_reset_then_bounded_chunks_stamped_with_the_tier() -> None:
    batches = full_state([Holder("fs", [b"a", b"b", b"c"]), Holder("s3", [b"d"], shared=True)], 2)
    kinds = [[(e.kind, e.keys, e.tier, e.shared) for e in batch] for batch in batches]
    assert kinds == [
        [(EventKind.CLEARED, (), "fs,s3", False), (EventKind.STORED, (b"a", b"b"), "fs", False)],
        [(EventKind.STORED, (b"c",), "fs", False)],
        [(EventKind.STORED, (b"d",), "s3", True)],
    ]
    assert batches[2][0].storage == "object"
    (alone,) = full_state([Holder("fs", [])])  # nothing held: the reset alone
    assert [e.kind for e in alone] == [EventKind.CLEARED]


# -- over the wire -------------------------------------------------------------------------------


async def fill(tier: FSTier, keys: list[bytes]) -> None:
    for i, key in enumerate(keys):
        await tier.store(key, memoryview(bytes([i]) * BLOCK))


class Watched:
    """A view that wakes its waiters after every batch it applies (no sleeps)."""

    def __init__(self, nodes: int = 1) -> None:
        self.view = ResidencyView(nodes)
        self.batches = 0  # applied, heartbeats (empty batches) included
        self._changed = anyio.Event()

    def apply(self, node: int, events: list[WireEvent]) -> None:
        self.view.apply(node, events)
        self.batches += 1
        self._changed.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        with anyio.fail_after(20):  # a failsafe: each step waits for a batch
            while not condition():
                await self._changed.wait()
                self._changed = anyio.Event()


async def test_a_restarted_node_announces_its_folder_and_a_late_router_asks_for_the_state(
    tmp_path: Path,
) -> None:
    keys = fresh_keys(5)
    async with FSTier(tmp_path / "c", name="disk") as tier:
        await fill(tier, keys[:3])  # what the node kept from before its restart
    watched = Watched()
    view = watched.view
    async with (
        FSTier(tmp_path / "c", name="disk") as tier,
        KVEventPublisher(ANY_PORT, block_size=16, replay_endpoint=ANY_PORT) as publisher,
        EventStream(tier) as stream,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(publisher.publish_stream, stream)  # announces the three
        await fill(tier, keys[3:4])
        await tier.delete(keys[0])
        subscriber = KVEventSubscriber(
            publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
            on_batch=functools.partial(watched.apply, 0),
        )
        async with subscriber:  # joins after all that: asks for the full state
            tg.start_soon(subscriber.run)
            await watched.until(lambda: view.believed(0, "disk") == set(keys[1:4]))
            assert subscriber.statistics.resets == 1
            await fill(tier, keys[4:])  # live from then on
            await watched.until(lambda: keys[4] in view.believed(0, "disk"))
            assert view.classes["disk"] == "disk"
            stream.close()
            tg.cancel_scope.cancel()
    stats = publisher.statistics()
    assert stats.full_states == 2  # the announcement and the answer


class Slow(Holder):
    """A tier whose full state is made only when the test lets the worker thread go on."""

    def __init__(self, name: str, keys: list[bytes]) -> None:
        super().__init__(name, keys)
        self.reading = threading.Event()
        self.release = threading.Event()

    def held_keys_reader(self) -> Callable[[], list[bytes]]:
        keys = list(self._keys)

        def read() -> list[bytes]:
            self.reading.set()
            self.release.wait(RECEIVE_MS / 1000)  # a failsafe: the test releases it
            return keys

        return read


async def test_what_happens_after_the_snapshot_goes_out_after_the_full_state(context: Any) -> None:
    """The full state's batches are made in a worker thread; a removal emitted meanwhile is
    news the snapshot does not hold, so it must reach the router after the state (before it,
    the state would bring the removed block back)."""
    tier = Slow("fs", [b"a"])
    async with (
        KVEventPublisher(ANY_PORT, block_size=4, heartbeat_s=None) as publisher,
        EventStream(tier) as stream,
        anyio.create_task_group() as tg,
    ):
        sub = subscriber(context, publisher.endpoint)
        await anyio.to_thread.run_sync(joined, publisher, sub)
        tg.start_soon(publisher.publish_stream, stream)
        await anyio.to_thread.run_sync(tier.reading.wait)  # the snapshot is taken
        tier.events.emit(EventKind.REMOVED, (b"a",), reason="evicted")
        await anyio.wait_all_tasks_blocked()  # the stream's consumer holds the removal
        tier.release.set()
        first, second = [(await anyio.to_thread.run_sync(sub.recv_multipart))[2] for _ in "ab"]
        sub.close()
        stream.close()
    assert [e.type for e in decode_events(msgspec.msgpack.decode(first))] == [
        "AllBlocksCleared",
        "BlockStored",
    ]
    assert [e.type for e in decode_events(msgspec.msgpack.decode(second))] == ["BlockRemoved"]


class Loading(Holder):
    """A tier whose index loads in the background (as an S3 tier's does)."""

    def __init__(self, name: str, keys: list[bytes]) -> None:
        super().__init__(name, keys, shared=True)
        self.loaded = anyio.Event()

    async def wait_index_loaded(self) -> bool:
        await self.loaded.wait()
        return True


async def test_the_full_state_waits_for_a_tier_whose_index_loads_in_the_background() -> None:
    """Announced before the load, it would say the node holds nothing there: a router taking
    it as a reset would drop the blocks only this node vouches for."""
    tier = Loading("s3", [b"listed"])
    watched = Watched()
    async with (
        KVEventPublisher(
            ANY_PORT, block_size=16, replay_endpoint=ANY_PORT, heartbeat_s=0.05
        ) as publisher,
        EventStream(tier) as stream,
        anyio.create_task_group() as tg,
    ):
        subscriber = KVEventSubscriber(
            publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
            on_batch=functools.partial(watched.apply, 0),
            request_timeout=0.5,
        )
        async with subscriber:
            tg.start_soon(subscriber.run)
            tg.start_soon(publisher.publish_stream, stream)
            await watched.until(lambda: watched.batches > 0)  # a heartbeat: subscribed
            tier.events.emit(EventKind.STORED, [b"live"])  # live batches go out meanwhile
            await watched.until(lambda: b"live" in watched.view.shared("s3"))
            assert publisher.statistics().full_states == 0
            assert subscriber.statistics.resets == 0  # its request waits for the load
            tier.loaded.set()
            await watched.until(lambda: watched.view.shared("s3") == {b"listed"})
            assert subscriber.statistics.resets >= 1
            stream.close()
            tg.cancel_scope.cancel()


async def test_a_full_state_request_without_a_stream_gets_the_end_marker_alone() -> None:
    view = ResidencyView(1)
    with KVEventPublisher(ANY_PORT, block_size=16, replay_endpoint=ANY_PORT) as publisher:
        subscriber = KVEventSubscriber(
            publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
            on_batch=functools.partial(view.apply, 0),
            request_timeout=10,
        )
        async with subscriber:
            with anyio.fail_after(5):  # the end marker comes at once, long before the timeout
                assert await subscriber.ask("full") is False
        assert publisher.statistics().full_states_unavailable == 1
        assert subscriber.tracker.next is None  # still not in sync: ``run`` would ask again
