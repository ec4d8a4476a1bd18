"""Developer sessions: `nox -s tests`, `lint`, `typecheck`, `docs`, `demo`, `two_nodes`, `bench`,
`gpu`, `vllm`.

torch is pinned to 2.13.0 here because on our machines that is a CPU build from local disk
(an unpinned torch pulls a multi-GB CUDA build); the project itself accepts a range.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.error_on_missing_interpreters = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
TORCH = "torch==2.13.0"


def install(session: nox.Session, *groups: str, extras: str = "s3,torch,metrics") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]", *nox.project.dependency_groups(PYPROJECT, *groups))


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite (starts one SeaweedFS on 127.0.0.1 for the S3 tests, and moto's
    threaded server for the credential tests; devtools/ holds both helpers)."""
    install(session, "test", "bench")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def stress(session: nox.Session) -> None:
    """The randomized manager state machine with many more examples than CI runs."""
    install(session, "test")
    session.env["KVTIER_STATEFUL_EXAMPLES"] = session.posargs[0] if session.posargs else "400"
    stateful = "tests/manager/test_manager_stateful.py"
    session.run("python", "-m", "pytest", stateful, "--timeout", "0")


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """The docs site (mkdocs.yml, docs/), API reference from the docstrings, warnings as errors.

    The settings tables are generated from the settings classes at build time, so kvtier is
    installed (no extras: the reference is read from the source). The site goes to a temporary
    folder unless a path is given: `nox -s docs -- site`.
    """
    session.install("-e", ".", *nox.project.dependency_groups(PYPROJECT, "docs"))
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    site = session.posargs[0] if session.posargs else session.create_tmp() + "/site"
    session.run("mkdocs", "build", "--strict", "--site-dir", site)


@nox.session
def typecheck(session: nox.Session) -> None:
    install(session, "typecheck")
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: examples/serve_demo.py (pass `-- --full` for the long run)."""
    install(session, "scripts")
    args = session.posargs or ["--quick"]
    if args == ["--full"]:
        args = []
    session.run("python", "examples/serve_demo.py", *args)


@nox.session
def two_nodes(session: nox.Session) -> None:
    """Two engine processes sharing one SeaweedFS bucket (examples/two_nodes.py; pass
    `-- --full` for the long run, with the ceiling: B with A's blocks already in memory)."""
    install(session, "test")
    args = session.posargs or ["--quick"]
    if args == ["--full"]:
        args = ["--ceiling"]
    session.run("python", "examples/two_nodes.py", *args)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in a short, bounded mode; each prints ratios against its baseline."""
    install(session, "test", "bench")
    scripts = (
        "bench_lookup.py",
        "bench_fs.py",
        "bench_s3.py",
        "bench_s3_packs.py",
        "bench_load.py",
    )
    for script in scripts:
        session.run("python", f"benchmarks/{script}", "--quick")
    session.run("python", "benchmarks/bench_demo_tiers.py", "--quick", "--rounds", "1")
    session.run("python", "benchmarks/replay_trace.py", "--quick")


@nox.session
def vllm(session: nox.Session) -> None:
    """kvtier as a vLLM secondary tier, driven by vLLM's own tiering manager (CPU only).

    vLLM 0.33.0 goes in with --no-deps (its wheel asks for torch 2.14 and CUDA packages), and
    so does xgrammar (it asks for triton); then only what vLLM's kv_offload tiering modules
    import, all under ci/vllm-constraints.txt, which keeps torch at the CPU 2.13.0 build.
    """
    constraints = ("-c", "ci/vllm-constraints.txt")
    session.install(*constraints, TORCH)
    groups = nox.project.dependency_groups(PYPROJECT, "test", "vllm")
    session.install(*constraints, "-e", ".[s3]", *groups)
    session.install(*constraints, "--no-deps", "vllm==0.33.0", "xgrammar==0.2.8")
    tests = ["tests/integrations/test_vllm_bridge.py", "tests/integrations/test_vllm_tier.py"]
    session.env["KVTIER_VLLM_REQUIRED"] = "1"  # here a missing import fails, never skips
    session.run("python", "-m", "pytest", *tests, *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU tests and GPU benchmark; says clearly that it skipped when there is no GPU."""
    install(session, "test", extras="s3,torch,metrics,cuda")
    probe = "import kvtier; ok, why = kvtier.cuda_available(); print(f'{ok}|{why}')"
    answer = session.run("python", "-c", probe, silent=True) or ""
    ok, _, why = str(answer).strip().partition("|")
    if ok != "True":
        session.skip(f"SKIPPED the GPU tests and benchmark: {why}")
    session.run("python", "benchmarks/gpu_check.py", *session.posargs)
