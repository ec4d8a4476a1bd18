"""Developer tools shared by the tests, the benchmarks, the examples and the noxfile: not part of
kvtier and not in its wheel (pyproject's package find takes ``kvtier*`` only).

- ``devtools.server_process``: the lifecycle of a real server process (start under a deadline,
  stop, kill -9, start again on the same ports) and the raw aiobotocore client for setup.
- ``devtools.weed_server``: SeaweedFS (``weed server`` with its S3 gateway) on 127.0.0.1.
- ``devtools.moto_server``: moto's ``ThreadedMotoServer`` on 127.0.0.1, for tests that inject
  S3 faults (IAM auth on, denied actions).

How it is imported: the tests get the repository root on their path from pytest's
``pythonpath`` setting (pyproject.toml). A script run by path from a checkout
(``python benchmarks/bench_s3.py``, ``python examples/serve_demo.py --s3-local``) needs it only
to start its own SeaweedFS; then, and only then, it puts the repository root on ``sys.path``
and imports ``devtools.weed_server`` (given an endpoint it needs nothing but kvtier). Nothing
in kvtier imports it.
"""
