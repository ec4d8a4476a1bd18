from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvtier import block_keys

TOKENS = list(range(1000, 1100))


def test_keys_are_identical_across_processes_and_hash_seeds() -> None:
    code = (
        "import kvtier; "
        "print(','.join(k.hex() for k in kvtier.block_keys(list(range(1000, 1100)), 16, "
        "namespace=b'model-a')))"
    )
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(proc.stdout.strip())
    assert len(outputs) == 1
    assert outputs.pop() == ",".join(k.hex() for k in block_keys(TOKENS, 16, namespace=b"model-a"))


def test_only_full_blocks_get_keys() -> None:
    assert len(block_keys(TOKENS, 16)) == 6  # 100 tokens: 6 full blocks, 4 left over
    assert block_keys(TOKENS[:15], 16) == []
    assert block_keys([], 16) == []
    # the partial block does not change the full blocks' keys
    assert block_keys(TOKENS[:96], 16) == block_keys(TOKENS, 16)


def test_keys_are_long_enough_and_carry_the_scheme_version() -> None:
    keys = block_keys(TOKENS, 16)
    assert all(len(k) >= 16 for k in keys)
    assert all(k[0] == 1 for k in keys)


def test_keys_chain_through_the_prefix() -> None:
    a = block_keys(TOKENS, 16)
    changed = list(TOKENS)
    changed[3] += 1  # first block differs: every later key must differ too
    b = block_keys(changed, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))
    changed = list(TOKENS)
    changed[40] += 1  # third block differs: the first two are shared
    c = block_keys(changed, 16)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:], strict=True))


def test_parent_continues_a_chain() -> None:
    full = block_keys(TOKENS[:64], 16)
    head = block_keys(TOKENS[:32], 16)
    tail = block_keys(TOKENS[32:64], 16, parent=head[-1])
    assert head + tail == full


def test_namespaces_block_sizes_and_parents_never_collide() -> None:
    seen: set[bytes] = set()
    total = 0
    for namespace in (b"", b"model-a", b"model-b", b"model-a\x00"):
        for size in (1, 2, 4, 8, 16):
            for parent in (None, bytes([1]) + bytes(15), bytes([1]) + b"\xff" * 15):
                keys = block_keys(TOKENS[:32], size, namespace=namespace, parent=parent)
                seen.update(keys)
                total += len(keys)
    assert len(seen) == total


def test_accepts_numpy_and_torch_token_ids() -> None:
    expected = block_keys(TOKENS, 16)
    assert block_keys(np.array(TOKENS, dtype=np.int32), 16) == expected
    assert block_keys(torch.tensor(TOKENS), 16) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"block_size": 2.5}, "block_size must be a positive int"),
        ({"block_size": 16, "namespace": "text"}, "namespace must be bytes"),
        ({"block_size": 16, "parent": "abc"}, "parent must be bytes"),
        ({"block_size": 16, "parent": b""}, "parent must be 1 to 255 bytes"),
    ],
)
def test_bad_arguments_say_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        block_keys(TOKENS, **kwargs)  # type: ignore[arg-type]


def test_bad_token_ids_say_what_to_fix() -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        block_keys([[1, 2], [3, 4]], 2)
    with pytest.raises(ValueError, match="integers"):
        block_keys([1.5, 2.5], 2)
    with pytest.raises(ValueError, match="non-negative"):
        block_keys([-1, 2], 2)
