"""benchmarks/bench_fs.py --latency-only: promotions against a reader that verifies what it read
(the floor cold, a plain read and xxh3 warm, into one buffer and into a slot per block) and
against plain reads, and warm promotions
against the same with every read in a worker thread, each with its baseline from the run."""

from __future__ import annotations

from tests.scripts.conftest import RunJson
from tests.scripts.runner import positive


def test_latency_only_gives_each_ratio_with_its_baseline(run_json: RunJson) -> None:
    args = ("--latency-only", "--samples", "4", "--repeat", "1", "--block-mib", "1")
    out = run_json("-m", "benchmarks.bench_fs", *args).out
    assert out["settings"]["loop_read_bytes"] is None  # the tier's default
    ratios = out["latency_ratios"]
    assert ratios["cold"]["baseline"] == "verifying read cold" and ratios["cold"]["aim"] == 1.1
    assert ratios["warm"]["baseline"] == "verifying read warm" and ratios["warm"]["aim"] == 1.25
    assert ratios["cold, of a plain read"]["baseline"] == "plain read cold"
    assert ratios["warm, of a plain read"]["baseline"] == "plain read warm"
    assert ratios["warm on the loop"]["baseline"] == "promotion warm, in a thread"
    slots = ratios["warm, of the floor into pool slots"]
    assert slots["baseline"] == "verifying read warm, into pool slots"
    assert all(positive(r["ratio"]) for r in ratios.values())
    medians = out["latency_ms_median"]
    assert positive(medians["verifying read cold"]) and positive(medians["verifying read warm"])
    assert positive(medians["loop cpu warm"]) and positive(medians["loop cpu warm, in a thread"])
    assert all(len(turns) == 1 for turns in out["latency_ms_turns"].values())  # --repeat 1
