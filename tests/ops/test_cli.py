"""The ``kvtier`` command line on real FS tier folders written by a real ``FSTier``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvtier.common._format import header_size
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._layout import MARKER_NAME, name_of
from tests.support import block_file, fresh_keys, run_cli

BLOCK = 4096
FILE = header_size(16) + BLOCK
N = 8


def populate(root: Path, n: int = N) -> dict[bytes, bytes]:
    """Store ``n`` blocks through a real FSTier and return them by key."""
    keys = fresh_keys(n)
    blocks = {key: os.urandom(BLOCK) for key in keys}

    async def store() -> None:
        async with FSTier(root, fsync="never") as tier:
            for key, payload in blocks.items():
                await tier.store(key, memoryview(payload))

    anyio.run(store)
    return blocks


def load_all(root: Path, blocks: dict[bytes, bytes]) -> dict[bytes, str]:
    """Load every block through a fresh FSTier: ``ok`` or the error's class name."""
    results: dict[bytes, str] = {}

    async def load() -> None:
        async with FSTier(root) as tier:
            for key, payload in blocks.items():
                dst = bytearray(BLOCK)
                try:
                    await tier.load(key, memoryview(dst))
                except Exception as exc:
                    results[key] = type(exc).__name__
                else:
                    results[key] = "ok" if bytes(dst) == payload else "WRONG BYTES"

    anyio.run(load)
    return results


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def blocks(root: Path) -> dict[bytes, bytes]:
    return populate(root)


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_counts_blocks_bytes_and_format(root: Path, blocks: dict[bytes, bytes]) -> None:
    code, out, err = run_cli("inspect", str(root))
    assert code == 0, err
    assert f"blocks:        {N} in" in out
    assert f"({N * FILE} bytes)" in out
    assert "layout 1, block format 2" in out
    assert "NOT readable" not in out
    assert "age:" in out and "newest" in out and "oldest" in out
    assert "temporary:     0 file(s)" in out


def test_inspect_json(root: Path, blocks: dict[bytes, bytes]) -> None:
    (root / "stray.txt").write_text("not a block")
    code, out, _ = run_cli("inspect", str(root), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["blocks"] == N
    assert report["bytes"] == N * FILE
    assert report["block_bytes_min"] == report["block_bytes_max"] == FILE
    assert report["layout"] == 1 and report["block_format"] == 2 and report["readable"]
    assert report["oldest"] <= report["newest"]
    assert report["foreign_entries"] == [str(root / "stray.txt")]


def test_inspect_counts_temporary_files_and_never_touches_them(
    root: Path, blocks: dict[bytes, bytes]
) -> None:
    key = next(iter(blocks))
    tmp = block_file(root, key).parent / f".tmp-deadbeef-1-0000-{name_of(key)}"
    tmp.write_bytes(b"half a block")
    code, out, _ = run_cli("inspect", str(root))
    assert code == 0
    assert "temporary:     1 file(s)" in out
    assert tmp.exists()


def test_inspect_empty_tier(root: Path) -> None:
    populate(root, 0)
    code, out, _ = run_cli("inspect", str(root))
    assert code == 0
    assert "blocks:        0 in 0 shard folders" in out


def test_inspect_refuses_a_folder_that_is_not_a_tier(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    code, out, err = run_cli("inspect", str(tmp_path))
    assert code == 2
    assert out == ""
    assert MARKER_NAME in err and "not a kvtier FS tier folder" in err
    code, _, err = run_cli("inspect", str(tmp_path / "missing"))
    assert code == 2 and "is not a folder" in err


# -- verify ------------------------------------------------------------------------------------


def test_verify_clean_tier(root: Path, blocks: dict[bytes, bytes]) -> None:
    code, out, err = run_cli("verify", str(root))
    assert code == 0, out + err
    assert f"{N} blocks checked" in out and f"{N} ok, 0 corrupt" in out
    assert "CORRUPT" not in out


def _flip_payload_byte(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_header_byte(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the fixed header: the header checksum catches it
    path.write_bytes(bytes(data))


def _truncate(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[: FILE // 2])


def _swap(path: Path, other: Path) -> None:
    path.write_bytes(other.read_bytes())  # an intact block, under another key's name


def _garbage(path: Path, other: Path) -> None:
    path.write_bytes(os.urandom(FILE))


CORRUPTIONS = {
    "payload": (_flip_payload_byte, "payload checksum mismatch"),
    "header": (_flip_header_byte, "header checksum mismatch"),
    "truncated": (_truncate, "payload is"),
    "swapped": (_swap, "block belongs to another key"),
    "garbage": (_garbage, "bad magic"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_verify_reports_a_corrupt_block_and_exits_1(
    root: Path, blocks: dict[bytes, bytes], kind: str
) -> None:
    corrupt, other = list(blocks)[:2]
    damage, reason = CORRUPTIONS[kind]
    damage(block_file(root, corrupt), block_file(root, other))
    code, out, _ = run_cli("verify", str(root))
    assert code == 1
    assert f"CORRUPT {block_file(root, corrupt)}: {reason}" in out
    assert out.count("CORRUPT") == 1
    assert f"{N - 1} ok, 1 corrupt" in out
    assert block_file(root, corrupt).exists()  # reported, not removed


def test_verify_remove_deletes_only_the_corrupt_block(
    root: Path, blocks: dict[bytes, bytes]
) -> None:
    corrupt = next(iter(blocks))
    _flip_payload_byte(block_file(root, corrupt), block_file(root, corrupt))
    code, out, _ = run_cli("verify", str(root), "--remove")
    assert code == 1
    assert "(removed)" in out and "1 corrupt (1 removed)" in out
    assert not block_file(root, corrupt).exists()
    assert sum(block_file(root, k).exists() for k in blocks) == N - 1
    # The folder is healthy again, and a tier opened on it serves every other block.
    code, out, _ = run_cli("verify", str(root))
    assert code == 0 and f"{N - 1} ok, 0 corrupt" in out
    results = load_all(root, blocks)
    assert results.pop(corrupt) == "BlockNotFoundError"
    assert set(results.values()) == {"ok"}


def test_verify_progress_bar_on_stderr(root: Path, blocks: dict[bytes, bytes]) -> None:
    code, out, err = run_cli("verify", str(root), "--progress", "always")
    assert code == 0
    assert "verify [" in err and f"{N}/{N} blocks" in err and err.endswith("\n")
    assert "verify [" not in out
    _, _, quiet = run_cli("verify", str(root), "--progress", "never")
    assert quiet == ""


def test_verify_refuses_another_format(root: Path, blocks: dict[bytes, bytes]) -> None:
    (root / MARKER_NAME).write_text(json.dumps({"format": "kvtier-fs", "layout": 99}))
    code, out, err = run_cli("verify", str(root))
    assert code == 2
    assert "layout 99" in err and out == ""
    code, out, _ = run_cli("inspect", str(root))
    assert code == 0 and "NOT readable by this kvtier" in out


def test_python_dash_m_kvtier_exit_codes(root: Path, blocks: dict[bytes, bytes]) -> None:
    """The real entry point, in a child process: exit codes are what scripts rely on."""
    cmd = [sys.executable, "-m", "kvtier"]
    ok = subprocess.run([*cmd, "verify", str(root)], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    _flip_payload_byte(block_file(root, next(iter(blocks))), root)
    bad = subprocess.run([*cmd, "verify", str(root)], capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and "CORRUPT" in bad.stdout
    usage = subprocess.run([*cmd, "frobnicate"], capture_output=True, text=True, check=False)
    assert usage.returncode == 2 and "usage: kvtier" in usage.stderr


# -- usage errors, config and bench -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [[], ["nope"], ["verify"], ["bench", "--blocks", "0"], ["verify", "x", "--progress", "x"]],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(*argv)[0] == 2
    assert "usage: kvtier" in capsys.readouterr().err


def write_config(path: Path, root: Path, extra: str = "") -> Path:
    path.write_text(
        f"""
[pool]
num_blocks = 16
block_bytes = "4KiB"

[fs]
root = "{root}"
fsync = "never"
{extra}
"""
    )
    return path


def test_bench_runs_the_configured_tiers_and_leaves_nothing_behind(
    tmp_path: Path, root: Path
) -> None:
    config = write_config(tmp_path / "kvtier.toml", root)
    code, out, err = run_cli("bench", "--config", str(config), "--blocks", "8", "--rounds", "2")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("block size 4.0 KiB")
    rows = {tuple(line.split()[:2]): line.split() for line in lines[2:]}
    assert set(rows) == {
        ("manager", "store"),
        ("manager", "lookup"),
        ("manager", "load"),
        ("fs", "store"),
        ("fs", "contains_many"),
        ("fs", "load"),
        ("fs", "delete"),
    }
    assert rows["fs", "load"][2:4] == ["8", "0"]  # count, errors
    assert rows["manager", "lookup"][2] == "16"  # 8 keys x 2 rounds
    code, out, _ = run_cli("inspect", str(root), "--json")
    assert json.loads(out)["blocks"] == 0


def test_bench_json_and_block_size(tmp_path: Path, root: Path) -> None:
    config = write_config(tmp_path / "kvtier.toml", root)
    argv = ["bench", "--config", str(config), "--blocks", "4", "--block-bytes", "8KiB", "--json"]
    code, out, _ = run_cli(*argv)
    assert code == 0
    report = json.loads(out)
    assert report["block_bytes"] == 8192
    fs_load = next(r for r in report["results"] if (r["target"], r["op"]) == ("fs", "load"))
    assert fs_load["count"] == 4 and fs_load["errors"] == 0
    assert fs_load["mib_per_s"] > 0 and fs_load["p50_ms"] <= fs_load["p99_ms"]


def test_bench_rejects_a_bad_config_naming_the_key(tmp_path: Path, root: Path) -> None:
    config = write_config(tmp_path / "kvtier.toml", root, 'fsync = "sometimes"')
    config.write_text(config.read_text().replace('fsync = "never"\n', ""))
    code, out, err = run_cli("bench", "--config", str(config))
    assert code == 2 and out == ""
    assert f"{config}: fs.fsync must be one of 'never', 'data', 'always'" in err
    code, _, err = run_cli("bench", "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "does not exist" in err


def test_config_command_hides_secrets(tmp_path: Path, root: Path) -> None:
    extra = """
[s3]
bucket = "kv-cache"
aws_access_key_id = "AKIDEXAMPLE"
aws_secret_access_key = "wJalrXUtnFEMI-very-secret"
"""
    config = write_config(tmp_path / "kvtier.toml", root, extra)
    code, out, _ = run_cli("config", "--config", str(config))
    assert code == 0
    shown = json.loads(out)
    assert shown["pool"]["block_bytes"] == 4096
    assert shown["s3"]["aws_secret_access_key"] == "***"
    assert "very-secret" not in out and "AKIDEXAMPLE" not in out


@pytest.mark.parametrize("command", ["config", "bench"])
def test_config_and_bench_reject_the_same_bucket_name(
    tmp_path: Path, root: Path, command: str
) -> None:
    config = write_config(tmp_path / "kvtier.toml", root, '[s3]\nbucket = "b"\n')
    code, out, err = run_cli(command, "--config", str(config))
    assert code == 2 and out == ""
    assert err.startswith(f"kvtier {command}: error: bucket 'b' is not a valid bucket name")


def test_config_names_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    config = tmp_path / "latin1.toml"
    config.write_bytes("[pool]\nnum_blocks = 16 # caf\u00e9\n".encode("latin-1"))
    code, out, err = run_cli("config", "--config", str(config))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"{config} is not UTF-8 text" in err


def test_version_in_process_and_as_a_module() -> None:
    from kvtier.common._version import version

    assert run_cli("--version") == (0, f"kvtier {version()}\n", "")
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True, check=False
    )
    assert (proc.returncode, proc.stdout) == (0, f"kvtier {version()}\n"), proc.stderr


# -- links out of the root -----------------------------------------------------------------------


def free_shard(folder: Path) -> str:
    return next(n for n in (f"{i:02x}" for i in range(256)) if not (folder / n).exists())


def plant_outside(tmp_path: Path, name: str = "abcdef0123456789abcdef0123456789") -> Path:
    """A folder outside the root holding a hex-named file that is not a valid block."""
    outside = tmp_path / "precious"
    outside.mkdir(exist_ok=True)
    (outside / name).write_bytes(b"not a kvtier block, and not yours to delete")
    return outside


def test_verify_remove_never_follows_links_out_of_the_root(
    tmp_path: Path, root: Path, blocks: dict[bytes, bytes]
) -> None:
    outside = plant_outside(tmp_path)
    a_shard = next(p for p in root.iterdir() if p.is_dir())
    first, second = free_shard(root), free_shard(a_shard)
    os.symlink(outside, root / first)  # a first-level shard folder that is a link
    os.symlink(outside, a_shard / second)  # a second-level one
    a_folder = next(p for p in a_shard.iterdir() if p.is_dir() and not p.is_symlink())
    os.symlink(outside / "abcdef0123456789abcdef0123456789", a_folder / "abcd")  # a block
    code, out, _ = run_cli("verify", str(root), "--remove")
    assert code == 0, out
    assert f"{N} blocks checked" in out
    assert (outside / "abcdef0123456789abcdef0123456789").exists()
    code, out, _ = run_cli("inspect", str(root), "--json")
    report = json.loads(out)
    assert report["blocks"] == N
    assert {Path(p).name for p in report["foreign_entries"]} == {first, second, "abcd"}


def test_verify_remove_survives_a_shard_swapped_for_a_link_mid_run(
    tmp_path: Path, root: Path, blocks: dict[bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder is scanned, then a shard folder is replaced by a link to a folder holding a
    corrupt file of the same name: the check must not read or delete through the link."""
    import kvtier._cli._folder as cli

    victim = block_file(root, next(iter(blocks)))
    outside = plant_outside(tmp_path, victim.name)
    real_scan = cli._scan

    def scan_then_swap(where: Path) -> Any:
        scan = real_scan(where)
        shard = victim.parent
        shard.rename(tmp_path / "moved-away")
        os.symlink(outside, shard)
        return scan

    monkeypatch.setattr(cli, "_scan", scan_then_swap)
    code, out, _ = run_cli("verify", str(root), "--remove")
    assert "removed" not in out.split("blocks checked")[0], out
    assert (outside / victim.name).exists()
    assert code in (0, 1)
