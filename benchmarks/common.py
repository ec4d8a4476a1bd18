"""What the benchmarks share: the ``--json`` output, the S3 options, and evicting files from
the page cache.

The benchmarks are modules of the ``benchmarks`` package, run from the repository root with
``python -m benchmarks.<name>`` (``nox -s bench`` does), so they import each other, this
module and ``examples.demo_engine`` by name, with nothing added to ``sys.path``.

``--json``: the benchmark prints exactly one JSON object on stdout, its figures, the ratios
with the baseline each is against, the settings it ran with and any check; its human output
goes to stderr. Without it the human output is all there is.

S3: a benchmark that needs an object store takes its endpoint (``--s3-endpoint``), a bucket
there that exists, and credentials (from the environment by default); ``nox -s bench`` starts a
SeaweedFS on 127.0.0.1 and passes its endpoint and its process id (``--s3-server-pid``), from
which a benchmark reads the CPU the store spent beside its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import kvtier

__all__ = [
    "add_json_flag",
    "add_s3_options",
    "json_output",
    "raw_client",
    "s3_tier",
    "server_cpu_reader",
    "settings",
]


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout (figures, ratios and baselines, settings, "
        "checks); the human output goes to stderr",
    )


@contextlib.contextmanager
def json_output(as_json: bool) -> Iterator[dict[str, Any]]:
    """A dict for the figures; with ``as_json`` the body's prints go to stderr and the dict
    is written to stdout as one JSON object when the body ends (a float that is not finite,
    such as a median of nothing, as null)."""
    figures: dict[str, Any] = {}
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr if as_json else stdout):
        yield figures
    if as_json:
        standard = json.loads(json.dumps(figures), parse_constant=lambda _: None)
        stdout.write(json.dumps(standard, allow_nan=False) + "\n")


def add_s3_options(parser: argparse.ArgumentParser, bucket: str) -> None:
    """``--s3-endpoint`` (required), ``--s3-bucket``, ``--s3-region``, the credentials and
    ``--s3-server-pid``."""
    s3 = parser.add_argument_group("the object store")
    s3.add_argument(
        "--s3-endpoint",
        required=True,
        help="the S3 endpoint URL (nox -s bench starts a SeaweedFS and passes it)",
    )
    s3.add_argument("--s3-bucket", default=bucket, help="a bucket there that exists")
    s3.add_argument("--s3-region", default=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    s3.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", "bench"))
    s3.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", "bench-secret"))
    s3.add_argument(
        "--s3-server-pid",
        type=int,
        help="the store's process id when it runs on this machine: its CPU is reported too",
    )


def s3_tier(args: argparse.Namespace, prefix: str, **options: Any) -> kvtier.S3Tier:
    """An S3 tier on the store the options name, under ``prefix``, with a 30 s read timeout
    (a loaded shared machine) and ``options``."""
    return kvtier.S3Tier(
        args.s3_bucket,
        prefix=prefix,
        endpoint_url=args.s3_endpoint,
        region_name=args.s3_region,
        aws_access_key_id=args.access_key,
        aws_secret_access_key=args.secret_key,
        read_timeout=30.0,
        **options,
    )


def raw_client(args: argparse.Namespace, **config: Any) -> Any:
    """A plain aiobotocore S3 client on the store the options name, with botocore's defaults
    but for ``config`` (``AioConfig`` settings): the baseline the tier is measured against."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    return get_session().create_client(
        "s3",
        endpoint_url=args.s3_endpoint,
        region_name=args.s3_region,
        aws_access_key_id=args.access_key,
        aws_secret_access_key=args.secret_key,
        config=AioConfig(**config),
    )


def settings(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options ``names`` of ``args``: what a run was asked for, as its JSON states it."""
    return {name: getattr(args, name) for name in names}


def server_cpu_reader(pid: int | None) -> Callable[[], float] | None:
    """A reader of process ``pid``'s CPU seconds so far (user + system, Linux /proc), or None
    without a pid."""
    if pid is None:
        return None

    def seconds() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    return seconds


def drop_cache(paths: Iterable[Path]) -> None:
    """Flush ``paths`` and evict them from the page cache, so the next read hits the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_page_cache() -> tuple[bool, str | None]:
    """``os.sync()``, then drop the clean page cache, dentries and inodes (``3`` into
    ``/proc/sys/vm/drop_caches``: root on a machine that allows it); whether it was dropped,
    and why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return False, f"page cache not dropped ({exc.strerror or exc}): reads meet it warm"
    return True, None
