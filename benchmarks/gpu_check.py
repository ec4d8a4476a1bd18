"""The first GPU run's script, one call within 8 minutes: the GPU tests (failing on any GPU
test that skips), CudaPool's copies against raw CuPy copies of the same bytes, the behaviour
checks where a GPU differs from the CUDA stand-in, and a block-size sweep; a short report
(``--json``: one JSON object instead).

    python -m benchmarks.gpu_check                 # everything, within 8 minutes
    python -m benchmarks.gpu_check --no-tests --blocks 256 --repeats 3 --json
    python -m benchmarks.gpu_check --dry-run --json   # no GPU needed: the plan and its shape

Without a GPU it prints ``SKIPPED: <why>`` and exits 0 (``nox -s gpu`` skips the same way);
on a machine with a GPU anything that skips or does not run fails it (exit 1).

Needs nothing from the network: torch (a CUDA build), CuPy (``import cupy``), numpy, and
kvtier from this working tree (run from the repository root, ``-m`` puts it on the path).
kvtier itself needs anyio and xxhash, and the tests need pytest, pytest-asyncio,
pytest-timeout and hypothesis; if the machine's Python lacks them, install them on a machine
with the same Python into ``.gpu_deps`` at the repository root (``pip install --target
.gpu_deps ...``), bring that folder along and run ``PYTHONPATH=.gpu_deps python -m
benchmarks.gpu_check``: the tests it starts get the same path.

Sections (JSON keys):

- ``tests``: ``tests/pools`` on every runtime; a skipped test fails the check, except the
  stand-in-only cases on the ``cupy`` runtime and the no-GPU cases;
- ``copies`` (``gpu_check_copies``): promotions and stores with realistic tiers, engine
  copies through torch and completion latency at 2 MiB, beside raw CuPy; aim: the realistic
  promotions and stores at least 0.8x their raw reference;
- ``probes`` (``gpu_check_probes``): engine-stream ordering without synchronising first, a
  graph capture beside copies in flight, a sticky fault while a copy is queued, a fresh
  thread's device and context, ``slot_bytes`` with copies queued;
- ``sizes`` (``gpu_check_sizes``): 16 KiB to 2 MiB blocks from pageable and pinned buffers,
  merged and unmerged, and HostPool with GPU buffers, each beside raw CuPy.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".gpu_deps"

MiB = 1 << 20
BLOCK = 2 * MiB
AIM = 0.8
NEEDED = ["numpy", "cupy", "anyio", "xxhash"]
FOR_TESTS = ["pytest", "pytest_asyncio", "pytest_timeout", "hypothesis"]
# Skips that are right on a GPU machine: stand-in-only cases on CuPy, no-GPU-only cases.
ALLOWED_SKIPS = ("needs the CUDA stand-in", "a CUDA GPU is visible")
SECTIONS = ("tests", "copies", "probes", "sizes")


def missing(modules: list[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def say(quiet: bool, *parts: object) -> None:
    if not quiet:
        print(*parts, flush=True)


def run_tests(quiet: bool) -> dict[str, Any]:
    """The pool tests, as a subprocess so a crash there cannot take the measurements down.
    Passes only when every test passed and none skipped for want of a GPU, torch or CuPy."""
    lacking = missing(FOR_TESTS)
    if lacking:
        return {"ok": False, "note": f"not run: missing {', '.join(lacking)} (.gpu_deps)"}
    env = dict(os.environ)
    if DEPS.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(DEPS), str(ROOT), env.get("PYTHONPATH", "")) if p
        )
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "tests/pools",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
        ]
        say(quiet, "$", " ".join(cmd))
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, timeout=240, check=False, capture_output=quiet
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "note": "timed out after 240 s"}
        skipped, passed = [], 0
        if report.exists():
            for case in ET.parse(report).iter("testcase"):
                skip = case.find("skipped")
                if skip is None:
                    passed += case.find("failure") is None and case.find("error") is None
                elif not any(a in (skip.get("message") or "") for a in ALLOWED_SKIPS):
                    skipped.append(f"{case.get('name')}: {skip.get('message')}")
    ok = proc.returncode == 0 and not skipped and passed > 0
    note = f"exit status {proc.returncode}, {passed} passed"
    if skipped:
        note += f", {len(skipped)} GPU test(s) skipped: " + "; ".join(skipped[:5])
    return {"ok": ok, "note": note, "passed": passed, "skipped": skipped}


# -- report ------------------------------------------------------------------------------------


def gbps(blocks: int, seconds: float) -> float:
    return blocks * BLOCK / seconds / 1e9


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256, help="2 MiB blocks per copy run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU needed: import every part, print the plan"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds the run may take before the sections left are reported as not run",
    )
    return parser.parse_args(argv)


def dry_run() -> dict[str, Any]:
    """Every part imported and the plan laid out as a real run reports it (no GPU call)."""
    from benchmarks import gpu_check_copies, gpu_check_probes, gpu_check_sizes

    plan = {"ok": None, "note": "dry run"}
    return {
        "dry_run": True,
        "tests": dict(plan),
        "copies": {**plan, "block_bytes": gpu_check_copies.BLOCK},
        "probes": {name: dict(plan) for name in gpu_check_probes.PROBES},
        "sizes": {**plan, "block_bytes": list(gpu_check_sizes.SIZES), "rows": []},
    }


def copies(cupy: Any, blocks: int, repeats: int) -> dict[str, Any]:
    """Raw CuPy copies, then CudaPool's promotions, stores, engine copies and latency."""
    import anyio

    from benchmarks import gpu_check_copies as c

    out: dict[str, Any] = {}
    payload = [os.urandom(BLOCK) for _ in range(32)]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "tier.bin")
        with open(path, "wb") as f:  # payload, then room for the stores
            f.write(b"".join(payload) + bytes(BLOCK * blocks))
        raw = c.Raw(cupy, blocks, payload, path)
        rawfig: dict[str, float] = {}
        for kind in ("noop", "memcpy", "file"):
            for bulk in (False, True):
                merged = "merged" if bulk else "per_block"
                t = c.median_time(functools.partial(raw.h2d, kind, bulk), repeats)
                rawfig[f"h2d_{kind}_{merged}"] = gbps(blocks, t)
                t = c.median_time(functools.partial(raw.d2h, kind, bulk), repeats)
                rawfig[f"d2h_{kind}_{merged}"] = gbps(blocks, t)
        for bulk in (False, True):
            rawfig[f"d2d_{'merged' if bulk else 'per_block'}"] = gbps(
                blocks, c.median_time(functools.partial(raw.d2d, bulk), repeats)
            )
        out["raw_gbps"] = rawfig
        out["raw_latency_us"] = raw.latency_us(200)
        rows: list[dict[str, Any]] = []
        for staging in (8, 32):
            times = anyio.run(c.pool_runs, staging, blocks, repeats, payload, path)
            for kind in ("noop", "memcpy", "file"):
                for op, direction in (("promote", "h2d"), ("store", "d2h")):
                    rate = gbps(blocks, times[f"{op}_{kind}"])
                    ref = rawfig[f"{direction}_{kind}_per_block"]
                    rows.append(
                        {
                            "operation": f"{op} ({kind} tier)",
                            "config": f"staging={staging}",
                            "gbps": rate,
                            "raw_gbps": ref,
                            "ratio": rate / ref,
                            "judged": kind != "noop",
                        }
                    )
    out["latency_us"] = anyio.run(c.latency_us, 200)
    engine = anyio.run(c.torch_runs, blocks, repeats)
    if isinstance(engine, str):
        out["engine_note"] = engine
    else:
        for op in ("store", "load"):
            rate, ref = gbps(blocks, engine[op]), rawfig["d2d_merged"]
            rows.append(
                {
                    "operation": f"engine {op} torch D2D",
                    "config": "merged runs",
                    "gbps": rate,
                    "raw_gbps": ref,
                    "ratio": rate / ref,
                    "judged": False,
                }
            )
    out["rows"] = rows
    met = all(r["ratio"] >= AIM for r in rows if r["judged"])
    out["aim"] = {"ratio": AIM, "met": met}
    out["ok"] = met and "engine_note" not in out
    return out


def print_copies(quiet: bool, section: dict[str, Any]) -> None:
    say(quiet, f"\n{'operation':<28}{'config':<14}{'GB/s':>8}{'raw GB/s':>10}{'ratio':>7}")
    for r in section["rows"]:
        mark = "" if r["judged"] else "  (information)"
        say(
            quiet,
            f"{r['operation']:<28}{r['config']:<14}{r['gbps']:>8.1f}{r['raw_gbps']:>10.1f}"
            f"{r['ratio']:>7.2f}{mark}",
        )
    say(quiet, "raw GB/s, per block and merged: " + json.dumps(section["raw_gbps"]))
    if "engine_note" in section:
        say(quiet, f"engine store/load via torch: not measured ({section['engine_note']})")
    say(
        quiet,
        f"completion latency, one 2 MiB fill: {section['latency_us']:.0f} us; raw "
        f"memcpyAsync+synchronize {section['raw_latency_us']:.0f} us",
    )
    met = section["aim"]["met"]
    say(quiet, f"aim {AIM}x on the realistic promotions and stores: {'met' if met else 'NOT met'}")


def print_sizes(quiet: bool, section: dict[str, Any]) -> None:
    say(quiet, f"\n{'pool':<6}{'memory':<10}{'runs':<10}{'block':>8}{'op':>7}{'GB/s':>8}")
    for r in section.get("rows", []):
        runs = "merged" if r["merged"] else "unmerged"
        say(
            quiet,
            f"{r['pool']:<6}{r['memory']:<10}{runs:<10}{r['block_bytes'] >> 10:>6}Ki"
            f"{r['operation']:>7}{r['gbps']:>8.1f}  raw {r['raw_gbps']:.1f}  x{r['ratio']:.2f}",
        )
    if section.get("wrong_bytes"):
        say(quiet, "wrong bytes: " + ", ".join(section["wrong_bytes"]))


def no_gpu_reason() -> tuple[bool, str]:
    """Whether this machine has no GPU (a skip, not a failure), and why; a GPU that torch
    sees but CuPy cannot use is a failure."""
    import kvtier

    ok, why = kvtier.cuda_available()
    if ok:
        return False, why
    try:
        import torch

        torch_gpu = bool(torch.cuda.is_available())
    except ImportError:
        torch_gpu = False
    return not torch_gpu, why


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    quiet = args.json
    result: dict[str, Any] = {"ok": False, "sections": list(SECTIONS)}

    def finish(code: int) -> int:
        result["ok"] = code == 0 and not result.get("skipped") and not result.get("dry_run")
        if quiet:
            print(json.dumps(result, indent=1))
        return code

    if args.dry_run:
        result.update(dry_run())
        say(quiet, "dry run: every part imports; sections " + ", ".join(SECTIONS))
        return finish(0)
    lacking = missing(["numpy", "anyio", "xxhash"])
    if lacking:
        result["error"] = f"cannot run: missing {', '.join(lacking)} (.gpu_deps)"
        say(quiet, result["error"])
        return finish(2)
    skip, why = no_gpu_reason()
    if skip:
        result["skipped"] = why
        say(quiet, f"SKIPPED the GPU tests and benchmark: {why}")
        return finish(0)
    deadline = time.monotonic() + args.budget
    if missing(["cupy"]):
        result["error"] = f"a GPU is visible but CuPy is not usable: {why}"
        say(quiet, result["error"])
        return finish(1)
    import anyio
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    result.update(
        device=name,
        cupy=cupy.__version__,
        cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
        cuda_driver=cupy.cuda.runtime.driverGetVersion(),
        blocks=args.blocks,
        block_bytes=BLOCK,
    )
    say(quiet, f"device 0: {name}; cupy {cupy.__version__}; {args.blocks} x 2 MiB blocks per run")
    tests = {"ok": True, "note": "not run (--no-tests)"} if args.no_tests else run_tests(quiet)
    result["tests"] = tests
    late = {"ok": False, "note": "not run: out of time"}
    result["copies"] = (
        copies(cupy, args.blocks, args.repeats) if time.monotonic() < deadline else late
    )
    from benchmarks.gpu_check_probes import run_probes
    from benchmarks.gpu_check_sizes import sweep

    result["probes"] = anyio.run(run_probes, deadline)
    result["sizes"] = anyio.run(sweep, args.repeats) if time.monotonic() < deadline else late
    if "rows" in result["copies"]:
        print_copies(quiet, result["copies"])
    print_sizes(quiet, result["sizes"])
    for probe, outcome in result["probes"].items():
        say(quiet, f"probe {probe}: {'ok' if outcome['ok'] else 'FAILED'} {json.dumps(outcome)}")
    say(quiet, f"tests: {'passed' if tests['ok'] else 'FAILED'} ({tests['note']})")
    passed = (
        tests["ok"]
        and result["copies"]["ok"]
        and all(p["ok"] for p in result["probes"].values())
        and result["sizes"]["ok"]
    )
    return finish(0 if passed else 1)


if __name__ == "__main__":
    sys.exit(main())
