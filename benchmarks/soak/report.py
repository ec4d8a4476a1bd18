"""The soak's figures, its verdict, its table and its reproducer.

``summarize`` adds up one or more runs into the figures ``--json`` prints (``operations``,
``faults_injected`` by kind, ``wrong_bytes``, ``foreign_bytes``, ``false_miss_rate``,
``deadline_overruns``, ``durable_losses``, ``leaks``, ``seed``, and the detail behind them);
``failures`` says what breaks the issue's bar (any wrong, foreign, durable loss or leak, a
worker crash or an exception kvtier let out, or a rate above its threshold); ``reproducer``
is what a failing run leaves for ``--replay``.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.soak.coordinator import RunResult, as_json, op_logs
from benchmarks.soak.settings import FALSE_MISS_LIMIT, OVERRUN_LIMIT

__all__ = ["failures", "reproducer", "summarize", "table"]

_LEAKS = ("threads", "tasks", "fds", "sockets", "pins")
_LOG_TAIL = 5000
_ALSO_ZERO = ("contract_errors", "open_failures")


def _leaks(counters: dict[str, int]) -> dict[str, int]:
    return {what: counters.get(f"leaked_{what}", 0) for what in _LEAKS}


def summarize(results: list[RunResult], *, seed: int) -> dict[str, Any]:
    c: dict[str, int] = {}
    faults: dict[str, int] = {}
    for r in results:
        for k, v in r.counters.items():
            c[k] = c.get(k, 0) + v
        for k, v in r.faults.items():
            faults[k] = faults.get(k, 0) + v
    leaks = _leaks(c)
    ops = c.get("ops", 0)
    probes = c.get("clean_probes", 0)
    summary: dict[str, Any] = {
        "operations": ops,
        "faults_injected": dict(sorted(faults.items())),
        "faults_total": sum(faults.values()),
        "wrong_bytes": c.get("wrong_bytes", 0),
        "foreign_bytes": c.get("foreign_bytes", 0),
        "false_miss_rate": c.get("false_misses", 0) / probes if probes else 0.0,
        "false_misses": c.get("false_misses", 0),
        "clean_probes": probes,
        "deadline_overruns": c.get("deadline_overruns", 0),
        "deadline_overrun_rate": c.get("deadline_overruns", 0) / ops if ops else 0.0,
        "durable_losses": c.get("durable_losses", 0),
        "durable_checked": c.get("durable_checked", 0),
        "leaks": sum(leaks.values()),
        "leaks_by_kind": leaks,
        "leak_checks": c.get("leak_checks", 0),
        "blocks_checked": c.get("blocks_checked", 0),
        "crashes": [x for r in results for x in r.crashes],
        "contract_errors": c.get("contract_errors", 0),
        "open_failures": c.get("open_failures", 0),
        "open_failures_transient": c.get("open_failures_transient", 0),
        "counters": c,
        "seed": seed,
        "seeds": [r.settings.seed for r in results],
        "wall_seconds": sum(r.wall_seconds for r in results),
        "workload_seconds": sum(r.workload_seconds for r in results),
        "notes": sorted({n for r in results for n in r.notes}),
        "kvtier": sorted({p for r in results for p in r.kvtier_paths}),
        "runs": [as_json(r) for r in results],
        "limits": {"false_miss_rate": FALSE_MISS_LIMIT, "deadline_overrun_rate": OVERRUN_LIMIT},
    }
    seconds = summary["workload_seconds"]
    summary["operations_per_second"] = ops / seconds if seconds else 0.0
    summary["faults_per_second"] = summary["faults_total"] / seconds if seconds else 0.0
    summary["failures"] = failures(summary)
    return summary


def failures(summary: dict[str, Any]) -> list[str]:
    zeros = ("wrong_bytes", "foreign_bytes", "durable_losses", "leaks")
    out = [f"{name}={summary[name]}" for name in (*zeros, *_ALSO_ZERO) if summary[name]]
    if summary["crashes"]:
        out.append(f"worker crashes={len(summary['crashes'])}")
    if summary["false_miss_rate"] > FALSE_MISS_LIMIT:
        out.append(f"false_miss_rate={summary['false_miss_rate']:.5f} > {FALSE_MISS_LIMIT}")
    if summary["deadline_overrun_rate"] > OVERRUN_LIMIT:
        out.append(
            f"deadline_overrun_rate={summary['deadline_overrun_rate']:.6f} > {OVERRUN_LIMIT}"
        )
    return out


def failed_run(result: RunResult) -> bool:
    return bool(failures(summarize([result], seed=result.settings.seed)))


def table(summary: dict[str, Any]) -> str:
    c = summary["counters"]
    rows = [
        ("seeds", ", ".join(str(s) for s in summary["seeds"])),
        (
            "wall / workload seconds",
            f"{summary['wall_seconds']:.0f} / {summary['workload_seconds']:.0f}",
        ),
        ("operations", f"{summary['operations']:,} ({summary['operations_per_second']:,.0f}/s)"),
        (
            "  lookups / scheduler / loads",
            f"{c.get('lookups', 0):,} / {c.get('scheduler_lookups', 0):,} / {c.get('loads', 0):,}",
        ),
        (
            "  stores / deletes / prefetches",
            f"{c.get('stores', 0):,} / {c.get('deletes', 0):,} / {c.get('prefetches', 0):,}",
        ),
        ("  durable stores / reopens", f"{c.get('durable_stores', 0):,} / {c.get('reopens', 0):,}"),
        ("blocks checked by the oracle", f"{summary['blocks_checked']:,}"),
        (
            "faults injected",
            f"{summary['faults_total']:,} ({summary['faults_per_second']:,.1f}/s)",
        ),
    ]
    rows += [(f"  {k}", f"{v:,}") for k, v in summary["faults_injected"].items()]
    rows += [
        ("wrong bytes", str(summary["wrong_bytes"])),
        ("foreign bytes", str(summary["foreign_bytes"])),
        (
            "false misses",
            f"{summary['false_misses']} of {summary['clean_probes']:,} clean probes "
            f"({summary['false_miss_rate']:.4%}; limit {FALSE_MISS_LIMIT:.1%})",
        ),
        ("  clean probes of protected keys", f"{c.get('protected_probes', 0):,}"),
        (
            "  probes excluded / deferred / unresolved",
            f"{c.get('probes_excluded', 0):,} / {c.get('probes_deferred', 0):,} / "
            f"{c.get('probes_unresolved', 0):,}",
        ),
        (
            "deadline overruns",
            f"{summary['deadline_overruns']} ({summary['deadline_overrun_rate']:.4%}; "
            f"limit {OVERRUN_LIMIT:.2%})",
        ),
        (
            "durable losses",
            f"{summary['durable_losses']} of {summary['durable_checked']:,} checked "
            f"({c.get('durable_evicted', 0):,} evicted by a full disk, not judged)",
        ),
        (
            "leaks",
            f"{summary['leaks']} in {summary['leak_checks']:,} closes "
            + " ".join(f"{k}={v}" for k, v in summary["leaks_by_kind"].items()),
        ),
        ("kvtier errors (counted, survived)", f"{c.get('kvtier_errors', 0):,}"),
        ("exceptions kvtier let out", str(summary["contract_errors"])),
        ("manager opens that raised", str(summary["open_failures"])),
        (
            "  on an injected fault",
            f"{c.get('open_failures_transient', 0):,} (not judged: such a tier does not yet "
            "open as unavailable; retried until it opens)",
        ),
        ("worker crashes", str(len(summary["crashes"]))),
        ("verdict", "FAIL: " + "; ".join(summary["failures"]) if summary["failures"] else "pass"),
    ]
    rows += [("note", note) for note in summary["notes"]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def reproducer(result: RunResult, path: str) -> None:
    """Write what ``--replay`` needs and what a person reads first: the settings (with the
    seed), the findings, and each worker incarnation's op log (its last lines)."""
    data = {
        "settings": result.settings.to_json(),
        "failures": failures(summarize([result], seed=result.settings.seed)),
        "result": as_json(result),
        "op_logs": op_logs(result.run_dir, _LOG_TAIL),
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
