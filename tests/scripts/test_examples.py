"""The examples run: serve_demo's quick mode end to end (with and without S3), two nodes
sharing a bucket, and the ASGI app's session; each read from its ``--json`` object."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from tests.scripts.conftest import RunJson
from tests.scripts.runner import Store, positive

pytest.importorskip("torch", reason="the examples need torch (the kvtier[torch] extra)")

from examples.demo_engine import FirstComeFirstServed  # after the skip: it needs torch

WITHOUT, WITH = "without kvtier", "with kvtier"


async def test_the_demo_engine_hands_out_slots_first_come_first_served() -> None:
    slots = FirstComeFirstServed[str]()
    order: list[tuple[str, str]] = []

    async def request(name: str) -> None:
        order.append((name, await slots.get()))

    async def finish_and_send_the_next_turn() -> None:
        # A request frees its slot and the same session asks again at once, with no await in
        # between: it must queue behind the requests already waiting, not take the slot.
        slots.put_nowait("a")
        await request("next turn")

    gave_up = anyio.CancelScope()

    async def give_up() -> None:
        with gave_up:
            await request("gave up")

    async with anyio.create_task_group() as tg:
        for name in ("first", "second"):
            tg.start_soon(request, name)
            await anyio.wait_all_tasks_blocked()
        tg.start_soon(give_up)
        await anyio.wait_all_tasks_blocked()
        gave_up.cancel()  # a waiter that gave up is skipped
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(finish_and_send_the_next_turn)
        await anyio.wait_all_tasks_blocked()
        for slot in "bc":
            slots.put_nowait(slot)
    assert order == [("first", "a"), ("second", "b"), ("next turn", "c")]


def assert_logits_match(out: dict[str, object]) -> None:
    """The demo's check passed: logits from loaded KV match the recompute, on some requests."""
    check = out["correctness"]
    assert isinstance(check, dict)
    assert check["ok"] is True
    assert check["compared"] > 0
    assert 0 <= check["max_abs_diff"] <= check["tolerance"] <= 1e-3


@pytest.mark.timeout(300)
def test_serve_demo_quick(run_json: RunJson, tmp_path: Path) -> None:
    fs_root = tmp_path / "fs"
    run = run_json(
        "examples/serve_demo.py", "--quick", "--fs-root", str(fs_root), "--metrics-port", "0"
    )
    out = run.out
    url = urlsplit(out["metrics_url"])
    assert (url.scheme, url.hostname, url.path) == ("http", "127.0.0.1", "/metrics")
    assert url.port
    runs = out["runs"]
    # the same requests ran both ways, and kvtier prefilled fewer tokens
    assert runs[WITH]["requests"] == runs[WITHOUT]["requests"] == out["settings"]["requests"] > 0
    assert 0 < runs[WITH]["prefill_tokens"] < runs[WITHOUT]["prefill_tokens"]
    assert all(positive(r[f"ttft_{q}_s"]) for r in runs.values() for q in ("p50", "p95"))
    assert out["speedup"]["baseline"] == WITHOUT
    assert positive(out["speedup"]["ttft_p50"]) and positive(out["speedup"]["ttft_p95"])
    blocks = out["blocks"]
    assert 0 < blocks["served"] <= blocks["loadable"]
    # every block served was resident, promoted from a tier, or stored meanwhile
    promoted = blocks["promoted"]
    assert set(promoted) == {"fs"}
    assert blocks["resident"] <= blocks["served"]
    assert blocks["served"] <= blocks["resident"] + sum(promoted.values()) + blocks["meanwhile"]
    # and the parts add up to the blocks served: a prefetched block is counted once
    assert blocks["resident"] + blocks["from_tiers"] + blocks["meanwhile"] == blocks["served"]
    assert 0 <= blocks["from_tiers"] <= sum(promoted.values()) and blocks["meanwhile"] >= 0
    assert out["tiers"] == ["host pool", "fs"]
    assert_logits_match(out)
    # the demo wrote its blocks through to the file tier it was given
    assert blocks["stored"] > 0
    assert out["tier_io"]["fs"]["stores"] > 0
    assert any(p.is_file() for p in fs_root.rglob("*") if len(p.name) == 32)
    assert "requests" in run.stderr  # the progress bar
    # queued requests were prefetched, and what was fetched for one went to its lookup
    prefetch = out["prefetch"]
    assert prefetch["started"] == out["settings"]["requests"]
    assert prefetch["blocks_claimed"] + prefetch["blocks_expired"] <= prefetch["blocks_prefetched"]
    assert prefetch["bytes_prefetched"] == prefetch["blocks_prefetched"] * 256 * 1024
    assert out["settings"]["no_prefetch"] is False
    assert all(r["lookup_wait_p50_s"] >= 0 for r in runs.values())


@pytest.mark.timeout(300)
def test_serve_demo_agent_workload(run_json: RunJson) -> None:
    """``--workload agent``: the four runs, labelled, each with its returning turns' TTFT;
    hints were given and claimed; loaded KV gave the recompute's logits. Figures are not
    asserted: they depend on the machine's load."""
    out = run_json("examples/serve_demo.py", "--workload", "agent", "--quick").out
    runs = out["runs"]
    assert list(runs) == ["without kvtier", "without hints", "with hints", "ceiling"]
    turns = out["settings"]["requests"]
    for figures in runs.values():
        assert figures["requests"] == turns
        assert figures["returning_turns"] == turns - out["settings"]["sessions"]
        assert all(positive(figures[f"returning_ttft_{q}_s"]) for q in ("p50", "p95"))
        assert positive(figures["returning_speedup_p50"])
    assert runs["without kvtier"]["blocks_loaded"] == 0
    assert runs["ceiling"]["blocks_loaded"] > 0
    workload = out["workload"]
    assert workload["kind"] == "agent" and workload["tiers"] == ["fs"]
    assert 0 < workload["pool_blocks"] < workload["blocks_touched"]
    assert workload["ceiling_pool_blocks"] >= workload["blocks_touched"]
    sessions = out["sessions"]
    assert sessions["turns"] == sessions["hinted"] == turns - out["settings"]["sessions"]
    assert sessions["claimed"] <= sessions["turns"]
    assert_logits_match(out)


@pytest.mark.timeout(300)
def test_serve_demo_with_an_s3_tier(run_json: RunJson, store: Store, tmp_path: Path) -> None:
    """The demo's S3 mode on the run's SeaweedFS: blocks are written to S3 (paced below the
    file tier, the rest deferred and each one accounted for), and no S3 request is made on the
    request path for keys the tier's index does not hold."""
    prefix = f"serve-demo/{tmp_path.name}/"
    out = run_json(
        "examples/serve_demo.py", "--quick", *store.flags(pid=False), "--s3-prefix", prefix
    ).out
    assert out["settings"]["s3_endpoint"] == store.endpoint
    assert out["tiers"] == ["host pool", "fs", "s3"]
    s3 = out["tier_io"]["s3"]
    assert s3["bytes_written"] > 0
    assert s3["request_path_requests"] == 0
    assert_logits_match(out)
    deferred = out["deferred"]  # S3 gets 2 MiB/s while serving: more than that is deferred
    assert deferred["kept"] > 0
    assert deferred["kept"] == deferred["written"] + deferred["given_up"]  # each accounted for


@pytest.mark.timeout(300)
def test_two_nodes_share_blocks_through_one_bucket(run_json: RunJson, store: Store) -> None:
    """Node B loads, from the bucket node A filled, blocks of the chats A computed; asks S3
    nothing on its request path for keys its index does not hold; and its logits with those
    blocks match its own recompute."""
    out = run_json("examples/two_nodes.py", "--quick", "--ceiling", *store.flags()).out
    assert out["node_a"]["written_to_s3"] > 0
    # A's blocks reached S3 in packs
    assert 0 < out["node_a"]["blocks_packed"] <= out["node_a"]["written_to_s3"]
    b = out["node_b"]
    without, shared = "without the shared tier", "with the shared tier"
    # The headline: TTFT of the first turn after the move, both ways, from the same run.
    first = b["first_turn_after_move"]
    assert first[without]["requests"] == first[shared]["requests"] > 0
    assert first["speedup"]["baseline"] == without
    assert positive(first["speedup"]["ttft_p50"]) and positive(first["speedup"]["ttft_p95"])
    assert b["all_turns"][shared]["from_s3"] > 0
    assert b["all_turns"][without]["from_s3"] == 0
    assert len(b["rounds"]) == out["settings"]["rounds"] == 1
    assert b["index_keys_at_open"] > 0
    assert b["request_path_requests"] == 0
    # B read A's blocks with fewer GETs than blocks
    assert 0 < b["pack_gets"] < b["pack_sections_read"]
    assert_logits_match(out)
    # The CPU B and the object store spent while B served, both ways and at the ceiling.
    cpu = out["cpu_while_b_served_s"]
    assert positive(cpu[without]["node"]) and positive(cpu[shared]["node"])
    assert cpu[shared]["server"] is not None and cpu[shared]["server"] >= 0
    top = out["ceiling"]
    assert positive(top["ttft_p50_s"]) and positive(top["speedup"]["ttft_p50"])
    assert top["speedup"]["baseline"] == without
    assert isinstance(top["s3_extra_cpu_ms_per_mib"], float)


@pytest.mark.timeout(120)
def test_asgi_app_serves_shared_prefixes(run_json: RunJson) -> None:
    pytest.importorskip("starlette", reason="the ASGI example needs starlette")
    pytest.importorskip("httpx", reason="the ASGI example's session runs through httpx")
    from prometheus_client.parser import text_string_to_metric_families

    out = run_json("examples/asgi_app.py", "--pool-blocks", "64").out
    system = out["settings"]["system_prompt"]
    first = out["first"]
    assert first["served_blocks"] == 0
    assert first["stored_blocks"] == first["prompt_tokens"] // 16 > 0
    assert len(first["completion"]) == 4

    # A second user with the same system prompt: its full blocks come from kvtier.
    second = out["second_user"]
    assert second["served_blocks"] >= len(system.encode()) // 16 - 1
    assert second["computed_tokens"] == second["prompt_tokens"] - 16 * second["served_blocks"]
    assert len(second["completion"]) == 2

    # The same prompt twice gives the same completion, with or without loaded KV.
    again = out["first_again"]
    assert again["served_blocks"] == again["prefix_blocks"] > 0
    assert again["completion"] == first["completion"]

    # Concurrent requests share one manager.
    assert len(out["concurrent"]) == 4
    assert all(r["served_blocks"] for r in out["concurrent"])

    stats = out["stats"]
    assert stats["blocks_loaded"] > 0
    assert stats["tiers"]["fs"]["blocks"] > 0

    assert out["metrics"]["status"] == 200  # prometheus_client's ASGI app, mounted
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for family in text_string_to_metric_families(out["metrics"]["text"])
        for s in family.samples
    }
    assert samples[("kvtier_tier_blocks", "fs")] == stats["tiers"]["fs"]["blocks"]

    assert out["bad_request"]["status"] == 400


@pytest.mark.timeout(240)
def test_kv_router_sends_turns_where_their_prefix_is(run_json: RunJson) -> None:
    """Every policy serves every request on fresh nodes; the router learns what each node
    holds from the events its file tier publishes (through ``KVEventSubscriber`` into a
    ``ResidencyView``), and KV-aware routing, sending later turns where their prefix is,
    loads more of each prompt than round-robin; the logits agree, and each shutdown leaves no
    task, publisher thread or folder behind."""
    pytest.importorskip("zmq", reason="the router example needs the kvtier[events] extra")
    pytest.importorskip("msgspec", reason="the router example needs the kvtier[events] extra")
    out = run_json("examples/kv_router.py", "--quick").out
    settings = out["settings"]
    nodes, requests = settings["nodes"], settings["sessions"] * settings["turns"]
    policies = out["policies"]
    assert list(policies) == ["round-robin", "block-count", "weighted"]
    rr = policies["round-robin"]
    for figures in policies.values():
        assert_router_figures(figures, nodes, requests)
        assert figures["s3_blocks_stored"] == [0] * nodes  # no shared tier in this mode
        assert figures["events"]["tier_classes"] == {"fs": "disk"}
    assert rr["requests_per_node"] == [requests // nodes] * nodes  # dealt in turn
    for policy in ("block-count", "weighted"):
        kv = policies[policy]
        assert rr["prompt_blocks"] == kv["prompt_blocks"] > 0  # the same requests each way
        assert kv["routed_to_a_known_prefix"] > 0
        assert kv["prefix_hit_ratio"] > rr["prefix_hit_ratio"]
        ratios = out[f"{policy.replace('-', '_')}_vs_round_robin"]
        assert ratios["baseline"] == "round-robin"
        assert positive(ratios["ttft_p50_speedup"]) and positive(ratios["ttft_p95_speedup"])
        assert ratios["prefix_hit_ratio_gain"] > 1
    assert out["weighted_vs_block_count"]["baseline"] == "block-count"
    assert_logits_match(out)


def assert_router_figures(figures: dict[str, Any], nodes: int, requests: int) -> None:
    """What holds for every policy's run: each request served once, the router's events
    only what the nodes sent, nothing left after the shutdown."""
    assert figures["requests"] == sum(figures["requests_per_node"]) == requests > 0
    assert len(figures["requests_per_node"]) == nodes > 1
    assert positive(figures["ttft_p50_s"]) and positive(figures["ttft_p95_s"])
    events = figures["events"]
    assert events["bad_messages"] == 0
    assert events["resets"] >= nodes  # each node's full state, taken before routing
    # the router learnt blocks only from events, and only blocks the nodes stored
    assert 0 < events["stored_blocks"] <= sum(figures["fs_blocks_stored"])
    assert events["batches"] <= sum(figures["published_batches"])
    assert figures["left_after_shutdown"] == {"tasks": 0, "event_threads": 0, "folders": 0}


@pytest.mark.timeout(300)
def test_kv_router_credits_a_shared_s3_tier_to_every_node(run_json: RunJson, store: Store) -> None:
    """With one S3 prefix shared by the nodes (the run's SeaweedFS), the first turns of some
    sessions live only in it when the run starts: the router keeps the shared tier's blocks
    once, credits them to every node (the tier's class from the events), and the nodes load
    them from the bucket; every policy serves the same requests and the logits agree."""
    pytest.importorskip("zmq", reason="the router example needs the kvtier[events] extra")
    out = run_json("examples/kv_router.py", "--quick", "--shared-s3", *store.flags(pid=False)).out
    settings = out["settings"]
    assert settings["shared_s3"] is True and settings["s3_endpoint"] == store.endpoint
    assert settings["tier_weights"]["object_store"] == 0.2
    nodes, requests = settings["nodes"], settings["sessions"] * settings["turns"]
    policies = out["policies"]
    for figures in policies.values():
        assert_router_figures(figures, nodes, requests)
        events = figures["events"]
        assert events["tier_classes"] == {"fs": "disk", "s3": "object_store"}
        assert events["shared_stored_blocks"] > 0 and events["shared_blocks_known_at_end"] > 0
        assert figures["shared_only_requests"] == settings["sessions"] // 2
        assert positive(figures["shared_only_ttft_p50_s"])
        assert sum(figures["s3_blocks_loaded"]) > 0  # the seeded blocks came from the bucket
    # Every node is credited with the shared blocks: round-robin's requests went to nodes
    # that never stored them and were still routed to a known prefix.
    assert policies["round-robin"]["routed_to_a_known_prefix"] == requests
    versus = out["weighted_vs_block_count"]
    assert versus["baseline"] == "block-count"
    assert positive(versus["ttft_p50_speedup"])
    assert positive(versus["shared_only_ttft_p50_speedup"])
    assert_logits_match(out)
