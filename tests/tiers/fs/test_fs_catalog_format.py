"""The FS catalog at rest: checkpoint and log bytes, and reading them back from a folder.

Format round trips, what a reader does with a torn log tail, a log of another generation, a
bad checksum, and input past the bounds; then a fuzz test: random bytes, truncations and bit
flips of valid files (and of valid files re-sealed with a good checksum, so the decoders get
past it) give a valid result or ``CatalogFormatError``, nothing else, within bounded memory.
"""

from __future__ import annotations

import array
import random
import struct
import tracemalloc
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvtier.tiers.fs import _catalog_files, _catalog_replay
from kvtier.tiers.fs._catalog_files import CHECKPOINT_NAME, LOG_NAME, JournalFiles, load
from kvtier.tiers.fs._catalog_format import (
    LOG_HEADER_SIZE,
    CatalogFormatError,
    Change,
    Frame,
    Limits,
    decode_checkpoint,
    decode_frames,
    decode_log_header,
    encode_checkpoint,
    encode_frame,
    encode_log_header,
)
from kvtier.tiers.fs._idents import name_of_ident
from kvtier.tiers.fs._layout import name_of
from kvtier.tiers.fs._packed_build import from_names, names_of, snapshot

LIMITS = Limits(max_entries=1000, max_file_bytes=1 << 20)


def name(i: int) -> str:
    return name_of(b"\x01" + i.to_bytes(15, "big"))


def sizes(*values: int) -> array.array[int]:
    return array.array("Q", values)


def checkpoint_of(n: int, generation: int = 7) -> bytes:
    return encode_checkpoint(generation, [name(i) for i in range(n)], sizes(*range(100, 100 + n)))


def frame(generation: int, *changes: tuple[Change, str, int]) -> bytes:
    ops = bytes(c for c, _, _ in changes)
    return encode_frame(
        generation, ops, [n for _, n, _ in changes], sizes(*(s for *_, s in changes))
    )


# -- checkpoint ---------------------------------------------------------------------------------


def test_a_checkpoint_round_trips() -> None:
    names = [name(i) for i in range(5)] + ["h" + "ab" * 32, "abc"]
    data = encode_checkpoint(42, names, sizes(*range(7)))
    got = decode_checkpoint(data, LIMITS)
    assert (got.generation, got.names, list(got.sizes)) == (42, names, list(range(7)))


def test_an_empty_checkpoint_round_trips() -> None:
    got = decode_checkpoint(encode_checkpoint(1, [], sizes()), LIMITS)
    assert (got.names, list(got.sizes)) == ([], [])


@pytest.mark.parametrize("where", [0, 20, 45, -3])
def test_a_flipped_bit_is_refused(where: int) -> None:
    data = bytearray(checkpoint_of(4))
    data[where] ^= 0x10
    with pytest.raises(CatalogFormatError):
        decode_checkpoint(bytes(data), LIMITS)


def test_a_checkpoint_past_the_bounds_is_refused_before_it_is_read() -> None:
    with pytest.raises(CatalogFormatError, match="past the bound"):
        decode_checkpoint(checkpoint_of(11), Limits(max_entries=10))


def resealed(body: bytes) -> bytes:
    """``body`` (a checkpoint without its checksum) with a good checksum."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@pytest.mark.parametrize(
    ("names", "why"),
    [
        (["../etc"], "character"),
        (["ab/cd"], "character"),
        (["a"], "shorter or longer"),
        (["a" * 201], "shorter or longer"),
        (["hab"], "not a block name"),
    ],
)
def test_names_that_are_not_block_names_are_refused(names: list[str], why: str) -> None:
    data = encode_checkpoint(3, names, sizes(*([1] * len(names))))
    with pytest.raises(CatalogFormatError, match=why):
        decode_checkpoint(data, LIMITS)


def test_a_size_past_any_block_is_refused() -> None:
    with pytest.raises(CatalogFormatError, match="size"):
        decode_checkpoint(encode_checkpoint(3, ["abab"], sizes(1 << 41)), LIMITS)


def test_another_version_is_refused() -> None:
    data = bytearray(checkpoint_of(2))
    data[8:12] = struct.pack("<I", 99)
    with pytest.raises(CatalogFormatError, match="version 99"):
        decode_checkpoint(resealed(bytes(data[:-8])), LIMITS)


# -- log ----------------------------------------------------------------------------------------


def test_log_frames_round_trip_and_a_torn_tail_is_cut() -> None:
    log = encode_log_header(5) + frame(5, (Change.ADD, name(1), 10), (Change.DROP, name(2), 0))
    good = len(log)
    log += frame(5, (Change.BACK, name(3), 30), (Change.SIZE, name(1), 11))
    assert decode_log_header(log) == 5
    frames, end = decode_frames(log, LOG_HEADER_SIZE, 5, 100)
    assert end == len(log)
    assert [list(f.ops) for f in frames] == [[1, 2], [3, 4]]
    assert frames[1].names == [name(3), name(1)] and list(frames[1].sizes) == [30, 11]
    for cut in range(good, len(log)):  # kill -9 mid-frame: everything before it stays
        frames, end = decode_frames(log[:cut], LOG_HEADER_SIZE, 5, 100)
        assert (len(frames), end) == (1, good)


def test_a_frame_of_another_generation_ends_the_log() -> None:
    log = encode_log_header(5) + frame(5, (Change.ADD, name(1), 10))
    good = len(log)
    log += frame(6, (Change.ADD, name(2), 10))
    frames, end = decode_frames(log, LOG_HEADER_SIZE, 5, 100)
    assert (len(frames), end) == (1, good)


def test_a_frame_with_a_bad_checksum_ends_the_log() -> None:
    log = bytearray(encode_log_header(5) + frame(5, (Change.ADD, name(1), 10)))
    log[-1] ^= 1
    frames, end = decode_frames(bytes(log), LOG_HEADER_SIZE, 5, 100)
    assert (frames, end) == ([], LOG_HEADER_SIZE)


def test_the_log_is_cut_past_its_bound_of_changes() -> None:
    log = encode_log_header(5) + b"".join(frame(5, (Change.ADD, name(i), 1)) for i in range(5))
    frames, _ = decode_frames(log, LOG_HEADER_SIZE, 5, 3)
    assert len(frames) == 3


# -- files ----------------------------------------------------------------------------------------


def kept(root: Path, generation: int, n: int) -> JournalFiles:
    files = JournalFiles(root, durable=False)
    files.checkpoint(generation, [name(i) for i in range(n)], sizes(*([10] * n)))
    return files


def test_a_folder_reads_back_checkpoint_and_log_replayed_in_order(tmp_path: Path) -> None:
    files = kept(tmp_path, 9, 4)
    files.append(9, None, [frame(9, (Change.ADD, name(0), 10), (Change.DROP, name(2), 0))])
    files.append(9, None, [frame(9, (Change.BACK, name(7), 70), (Change.SIZE, name(3), 33))])
    files.close()
    loaded, why = load(tmp_path, LIMITS)
    assert loaded is not None, why
    assert loaded.names == [name(7), name(1), name(3), name(0)]
    assert list(loaded.sizes) == [70, 10, 33, 10]
    assert (loaded.checkpoint_entries, loaded.log_changes) == (4, 4)
    assert loaded.log_end == (tmp_path / LOG_NAME).stat().st_size


def test_a_log_left_from_an_older_checkpoint_is_ignored(tmp_path: Path) -> None:
    files = kept(tmp_path, 9, 2)
    files.append(9, None, [frame(9, (Change.DROP, name(0), 0))])
    old_log = (tmp_path / LOG_NAME).read_bytes()
    kept(tmp_path, 10, 2).close()  # a new checkpoint ...
    (tmp_path / LOG_NAME).write_bytes(old_log)  # ... whose log a kill -9 never made
    loaded, _ = load(tmp_path, LIMITS)
    assert loaded is not None and loaded.names == [name(0), name(1)]
    assert loaded.log_end is None and loaded.log_note and "older" in loaded.log_note


def test_appending_goes_on_after_the_last_good_frame(tmp_path: Path) -> None:
    files = kept(tmp_path, 9, 2)
    files.append(9, None, [frame(9, (Change.DROP, name(0), 0))])
    files.close()
    with (tmp_path / LOG_NAME).open("ab") as f:
        f.write(frame(9, (Change.DROP, name(1), 0))[:-3])  # torn
    loaded, _ = load(tmp_path, LIMITS)
    assert loaded is not None and loaded.names == [name(1)] and loaded.log_end is not None
    again = JournalFiles(tmp_path, durable=False)
    again.append(9, loaded.log_end, [frame(9, (Change.ADD, name(5), 5))])
    again.close()
    loaded, _ = load(tmp_path, LIMITS)
    assert loaded is not None and loaded.names == [name(1), name(5)]


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("missing", "no checkpoint"),
        ("flipped", "damaged"),
        ("link", "cannot read"),
        ("big", "past"),
    ],
)
def test_a_folder_without_a_usable_checkpoint_says_why(
    tmp_path: Path, damage: str, why: str
) -> None:
    kept(tmp_path, 9, 3).close()
    path = tmp_path / CHECKPOINT_NAME
    if damage == "missing":
        path.unlink()
    elif damage == "flipped":
        raw = bytearray(path.read_bytes())
        raw[50] ^= 4
        path.write_bytes(bytes(raw))
    elif damage == "link":
        (tmp_path / "elsewhere").write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.write_bytes(path.read_bytes() + bytes(2 << 20))
    loaded, reason = load(tmp_path, LIMITS)
    assert loaded is None and why in reason


def test_half_written_files_are_removed_at_load(tmp_path: Path) -> None:
    kept(tmp_path, 9, 1).close()
    stale = tmp_path / ".kvtier-fs-catalog-tmp-1-abcd"
    stale.write_bytes(b"half")
    load(tmp_path, LIMITS)
    assert not stale.exists()


# -- fuzz ------------------------------------------------------------------------------------------


def mutations(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    out: list[bytes] = []
    for _ in range(count):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(0, 2 * len(data) + 1)))
        elif kind == 1:
            out.append(data[: rng.randrange(len(data) + 1)])
        else:
            raw = bytearray(data)
            for _ in range(rng.randrange(1, 8)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            out.append(bytes(raw))
    return out


def test_fuzz_the_decoders() -> None:
    rng = random.Random(1234)
    names = [name(i) for i in range(20)] + ["h" + "cd" * 32]
    checkpoint = encode_checkpoint(77, names, sizes(*range(21)))
    log = encode_log_header(77) + b"".join(
        frame(77, (Change(1 + i % 4), names[i], i)) for i in range(len(names))
    )
    tracemalloc.start()
    try:
        for data in mutations(checkpoint, rng, 1500):
            for candidate in (data, resealed(data[:-8]) if len(data) >= 8 else data):
                try:
                    got = decode_checkpoint(candidate, LIMITS)
                except CatalogFormatError:
                    continue
                assert len(got.names) == len(got.sizes) <= LIMITS.max_entries
                assert all(len(n) <= 200 and "/" not in n and "." not in n for n in got.names)
        for data in mutations(log, rng, 1500):
            try:
                decode_log_header(data)
            except CatalogFormatError:
                pass
            frames, end = decode_frames(data, LOG_HEADER_SIZE, 77, 100)
            assert LOG_HEADER_SIZE <= end <= max(len(data), LOG_HEADER_SIZE)
            assert sum(len(f.ops) for f in frames) <= 100
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # inputs of a few KiB never make the decoders allocate more


def test_fuzz_the_files(tmp_path: Path) -> None:
    """Damaged files in a folder: ``load`` answers a catalog or a reason, never raises."""
    rng = random.Random(99)
    files = kept(tmp_path, 5, 6)
    files.append(5, None, [frame(5, (Change.ADD, name(0), 10), (Change.DROP, name(3), 0))])
    files.close()
    checkpoint = (tmp_path / CHECKPOINT_NAME).read_bytes()
    log = (tmp_path / LOG_NAME).read_bytes()
    for cp, lg in zip(mutations(checkpoint, rng, 200), mutations(log, rng, 200), strict=True):
        (tmp_path / CHECKPOINT_NAME).write_bytes(cp if rng.random() < 0.5 else checkpoint)
        (tmp_path / LOG_NAME).write_bytes(lg)
        loaded, why = load(tmp_path, LIMITS)
        assert loaded is not None or why
        if loaded is not None:
            assert set(loaded.names) <= {name(i) for i in range(8)}


def test_the_steps_are_named_once() -> None:
    assert _catalog_files.STEPS == (
        "checkpoint_written",
        "checkpoint_renamed",
        "log_written",
        "log_renamed",
    )


@pytest.mark.parametrize("seed", range(30))
def test_replaying_onto_the_packed_index_is_the_catalogs_own_operations(seed: int) -> None:
    """The log replayed onto the checkpoint's packed index, one change at a time or (a log
    of adds and drops only) computed as columns, leaves what the catalog's own operations on
    an ``OrderedDict`` leave, repeated names within a frame included."""
    rng = random.Random(seed)
    plain = seed % 2 == 0  # adds and drops only: the columns' way
    start = [(name(i), i) for i in range(30)]
    frames = []
    for _ in range(6):
        changes = []
        for _ in range(rng.randrange(1, 8)):
            op = rng.choice([Change.ADD, Change.DROP] if plain else list(Change))
            changes += [
                (op, name(rng.randrange(50)), rng.randrange(1, 99))
                for _ in range(rng.randrange(1, 12))
            ]
        frames.append(
            Frame(
                bytes(c for c, _, _ in changes),
                [n for _, n, _ in changes],
                sizes(*(s for *_, s in changes)),
            )
        )
    expected: OrderedDict[str, int] = OrderedDict(start)  # the catalog's own operations:
    for f in frames:
        for code, n, size in zip(f.ops, f.names, f.sizes, strict=True):
            if code == Change.ADD:
                expected.pop(n, None)
                expected[n] = size
            elif code == Change.DROP:
                expected.pop(n, None)
            elif code == Change.BACK and n not in expected:
                expected[n] = size
                expected.move_to_end(n, last=False)
            elif code == Change.SIZE and n in expected:
                expected[n] = size
    order = from_names([n for n, _ in start], np.arange(30, dtype=np.uint64))
    _catalog_replay.replay(order, frames, 1000)
    assert [(name_of_ident(i), size) for i, size in order.items()] == list(expected.items())
    columns = snapshot(from_names([n for n, _ in start], np.arange(30, dtype=np.uint64)))
    built, base = _catalog_replay.replayed(columns, frames, 1000)
    assert [(name_of_ident(i), size) for i, size in built.items()] == list(expected.items())
    assert sorted(zip(names_of(base), base.sizes.tolist(), strict=True)) == sorted(expected.items())
    with pytest.raises(CatalogFormatError):
        _catalog_replay.replayed(columns, frames, len(expected) - 1)


@pytest.mark.parametrize("seed", range(12))
def test_a_full_tiers_log_replays_at_once_as_one_change_at_a_time(seed: int) -> None:
    """A full tier's log alternates drops of old blocks and adds of new ones (one change a
    run), with loads re-adding held ones: computed at once (keys of one length) or, with a
    longer key among them, the general way, it leaves what replaying each change leaves."""
    rng = random.Random(seed)
    longer = seed % 3 == 0
    pool = [name(i) for i in range(400)] + ([name_of(bytes(40) + bytes([seed]))] if longer else [])
    start = pool[: rng.randrange(0, 200)]
    frames: list[Frame] = []
    for _ in range(rng.randrange(1, 5)):
        changes = []
        for _ in range(rng.randrange(1, 60)):
            changes.append((Change.DROP, rng.choice(pool), 0))
            changes.append((Change.ADD, rng.choice(pool), rng.randrange(1, 1 << 40)))
        if longer and not frames:
            changes.append((Change.ADD, pool[-1], 5))
        frames.append(
            Frame(
                bytes(c for c, _, _ in changes),
                [n for _, n, _ in changes],
                sizes(*(s for *_, s in changes)),
            )
        )
    start_sizes = np.arange(1, len(start) + 1, dtype=np.uint64)
    order = from_names(start, start_sizes)
    _catalog_replay.replay(order, frames, 10_000)
    columns = snapshot(from_names(start, start_sizes))
    built, base = _catalog_replay.replayed(columns, frames, 10_000)
    assert (_catalog_replay._of_one_width(columns, frames, 10_000) is None) is longer
    assert list(built.items()) == list(order.items())
    assert names_of(base) == [name_of_ident(i) for i in order]


def test_names_of_unequal_lengths_are_never_read_as_one_width() -> None:
    names = ["abcd", "abcdef", "ab"]  # 12 digits: three names of 4 as well
    assert _catalog_replay._idents_of(names) == [b"\xab\xcd", b"\xab\xcd\xef", b"\xab"]
