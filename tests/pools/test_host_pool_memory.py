"""A host pool larger than the machine's memory is refused at once, with the size asked and
the size the machine has, before the slot table or the mapping is built."""

from __future__ import annotations

import pytest

import kvtier
from kvtier.pools._host import check_host_memory, host_memory_bytes


def test_the_machine_reports_its_memory() -> None:
    have = host_memory_bytes()
    assert have is not None
    assert have[0] > 0 and have[1] == "physical memory"


def test_a_pool_far_beyond_physical_memory_fails_fast_naming_both_sizes() -> None:
    with pytest.raises(kvtier.InvalidArgumentError) as caught:
        kvtier.HostPool(num_blocks=10**9, block_bytes=1 << 20)
    message = str(caught.value)
    assert f"{10**9 * (1 << 20):,} bytes" in message
    assert "does not fit in this machine's" in message and "lower num_blocks" in message


def test_a_stated_limit_is_named_in_the_error() -> None:
    check_host_memory(4096, limit=(4096, "test limit"))
    with pytest.raises(kvtier.InvalidArgumentError, match="test limit of 4,096 bytes"):
        check_host_memory(4097, limit=(4096, "test limit"))


def test_a_normal_pool_still_works() -> None:
    pool = kvtier.HostPool(num_blocks=8, block_bytes=4096)
    slot = pool.try_reserve(b"k" * 16)
    assert slot is not None
    pool.slot_view(slot)[:4] = b"abcd"
    assert pool.copy_slot(slot)[:4] == b"abcd"


def test_bad_sizes_are_still_refused_by_name() -> None:
    with pytest.raises(kvtier.InvalidArgumentError, match="num_blocks"):
        kvtier.HostPool(num_blocks=0, block_bytes=4096)
