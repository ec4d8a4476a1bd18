"""``python -m devtools.with_seaweedfs BUCKET COMMAND...``: run a script against a SeaweedFS
started for it, the way the nox sessions run the demo, the two-node example and the S3
benchmarks.

It starts ``weed`` on 127.0.0.1 (``devtools.weed_server``), creates BUCKET, then runs COMMAND
with ``{endpoint}`` and ``{pid}`` replaced by the server's endpoint URL and process id, and with
S3 credentials the server accepts in its environment; the server stops when the command ends,
and the command's exit status is this one's. Run it from the repository root (so ``devtools``
imports as it does in the tests), in an environment with anyio, aiobotocore and ``weed``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import anyio

from devtools.weed_server import ACCESS_KEY, REGION, SECRET_KEY, WeedServer, ensure_bucket

__all__ = ["main"]

USAGE = "usage: python -m devtools.with_seaweedfs BUCKET COMMAND [ARG...]"


def main(argv: Sequence[str] | None = None) -> int:
    """Start the server, run the command against it, stop the server; the command's status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    bucket, *command = args
    with WeedServer() as server:
        anyio.run(ensure_bucket, server.endpoint_url, bucket)
        given = {"{endpoint}": server.endpoint_url, "{pid}": str(server.pid)}
        credentials = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        env = {**os.environ, **credentials, "AWS_DEFAULT_REGION": REGION}
        done = subprocess.run([given.get(a, a) for a in command], env=env, check=False)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
