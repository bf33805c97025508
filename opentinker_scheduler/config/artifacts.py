"""The ``artifacts:`` section: where checkpoints live and how many are kept.

.. code-block:: yaml

    artifacts:
      backend: local            # local (default: under state_dir/artifacts, trainers upload over gRPC)
                                # or s3 (trainers move bytes with URLs the scheduler presigns)
      keep_checkpoints: 3       # newest periodic checkpoints kept per task, besides the final one
      checkpoint_retries: 3     # tries of one checkpoint upload (backoff 1, 2, 4 ... s) before it counts as failed
      max_failed_checkpoints: 3 # checkpoints in a row that could not be stored before the task FAILs
      s3:                       # backend s3 only; the scheduler's credentials from the AWS environment or files
        endpoint: http://seaweedfs:8333   # empty: AWS S3 itself
        bucket: opentinker
        prefix: cluster-a/      # optional
        region: us-east-1       # optional
        presign_expires_s: 900  # optional: seconds a presigned PUT or GET URL stays valid
        multipart_part_bytes: 5368709120  # optional: a trainer sends a larger file in parts of this size

The scheduler refuses to start when the ``s3`` store cannot be reached or refuses its
credentials, naming the endpoint (``opentinker_scheduler.data.artifact_store.open_artifact_store``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_PREFIX = re.compile(r"([A-Za-z0-9_\-][A-Za-z0-9._\-]*/)*")


@dataclass(frozen=True)
class S3Config:
    bucket: str
    endpoint: str = ""
    prefix: str = ""
    region: str = "us-east-1"
    #: Seconds a presigned PUT or GET URL stays valid; it must cover the transfer of one file or part.
    presign_expires_s: int = 900
    #: A trainer sends a file larger than this (bytes) in parts of this size; 5 MiB to 5 GiB.
    multipart_part_bytes: int = 5 * 1024**3


@dataclass(frozen=True)
class ArtifactsConfig:
    """The ``artifacts:`` section (see the module docstring)."""

    backend: str = "local"
    keep_checkpoints: int = 3
    checkpoint_retries: int = 3
    max_failed_checkpoints: int = 3
    s3: S3Config | None = None


def parse_artifacts(r, node) -> ArtifactsConfig:
    """Parse ``artifacts:`` with the config reader ``r`` (``file:line:column: key: expected ...``)."""
    m = r.mapping(
        node,
        "artifacts",
        {"backend": "", "keep_checkpoints": "", "checkpoint_retries": "", "max_failed_checkpoints": "", "s3": ""},
    )
    kw: dict = {}
    if "backend" in m:
        backend = r.scalar(m["backend"][1], "artifacts.backend", str)
        if backend not in ("local", "s3"):
            raise r.fail(m["backend"][1], "artifacts.backend", f"local or s3, got {backend!r}")
        kw["backend"] = backend
    counts = (("keep_checkpoints", 1, 1000), ("checkpoint_retries", 1, 20), ("max_failed_checkpoints", 1, 100))
    for key, lo, hi in counts:
        if key in m:
            kw[key] = r.scalar(m[key][1], f"artifacts.{key}", int, lo, hi)
    if "s3" in m:
        s = r.mapping(
            m["s3"][1],
            "artifacts.s3",
            {
                "endpoint": "",
                "bucket": "",
                "prefix": "",
                "region": "",
                "presign_expires_s": "",
                "multipart_part_bytes": "",
            },
        )
        if "bucket" not in s:
            raise r.fail(m["s3"][1], "artifacts.s3.bucket", "a bucket name (required)")
        bucket = r.scalar(s["bucket"][1], "artifacts.s3.bucket", str)
        if not _BUCKET.fullmatch(bucket):
            want = f"an S3 bucket name (3-63 of a-z 0-9 . -), got {bucket!r}"
            raise r.fail(s["bucket"][1], "artifacts.s3.bucket", want)
        endpoint = r.scalar(s["endpoint"][1], "artifacts.s3.endpoint", str) if "endpoint" in s else ""
        if endpoint and not re.fullmatch(r"https?://[^/\s]+/?", endpoint):
            raise r.fail(s["endpoint"][1], "artifacts.s3.endpoint", f"http(s)://host:port, got {endpoint!r}")
        prefix = r.scalar(s["prefix"][1], "artifacts.s3.prefix", str) if "prefix" in s else ""
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        if not _PREFIX.fullmatch(prefix):
            want = f"/-separated parts of letters, digits and ._-, got {prefix!r}"
            raise r.fail(s["prefix"][1], "artifacts.s3.prefix", want)
        region = r.scalar(s["region"][1], "artifacts.s3.region", str) if "region" in s else "us-east-1"
        expires = 900
        if "presign_expires_s" in s:
            expires = r.scalar(s["presign_expires_s"][1], "artifacts.s3.presign_expires_s", int, 1, 43200)
        part = 5 * 1024**3
        if "multipart_part_bytes" in s:
            key = "artifacts.s3.multipart_part_bytes"
            part = r.scalar(s["multipart_part_bytes"][1], key, int, 5 * 1024**2, 5 * 1024**3)
        kw["s3"] = S3Config(
            bucket=bucket,
            endpoint=endpoint.rstrip("/"),
            prefix=prefix,
            region=region,
            presign_expires_s=expires,
            multipart_part_bytes=part,
        )
    cfg = ArtifactsConfig(**kw)
    if cfg.backend == "s3" and cfg.s3 is None:
        raise r.fail(node, "artifacts.s3", "an s3: section (bucket, endpoint) with backend: s3")
    if cfg.backend == "local" and cfg.s3 is not None:
        raise r.fail(m["s3"][1], "artifacts.s3", "no s3: section with backend: local (or set backend: s3)")
    return cfg
