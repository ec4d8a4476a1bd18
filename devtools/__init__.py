"""Developer tools shared by the tests, the benchmarks, the examples and the noxfile: not part of
kvtier and not in its wheel (pyproject's package find takes ``kvtier*`` only).

- ``devtools.server_process``: the lifecycle of a real server process (start under a deadline,
  stop, kill -9, start again on the same ports) and the raw aiobotocore client for setup.
- ``devtools.weed_server``: SeaweedFS (``weed server`` with its S3 gateway) on 127.0.0.1.
- ``devtools.moto_server``: moto's ``ThreadedMotoServer`` on 127.0.0.1, for tests that inject
  S3 faults (IAM auth on, denied actions).
- ``devtools.silent_endpoint``: an endpoint on 127.0.0.1 that accepts connections and never
  answers (a silent S3 endpoint, for the tests and ``benchmarks/open_unreachable.py``).
- ``devtools.with_seaweedfs``: ``python -m devtools.with_seaweedfs BUCKET COMMAND...`` runs a
  script against a SeaweedFS started for it (the nox sessions that need S3 use it).

How it is imported: the tests get the repository root on their path from pytest's
``pythonpath`` setting (pyproject.toml), and the nox sessions that start SeaweedFS for a
script run ``python -m devtools.with_seaweedfs`` from the root. Scripts never import it: they
take ``--s3-endpoint``.
Nothing in kvtier imports it.
"""
