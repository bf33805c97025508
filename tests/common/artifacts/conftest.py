"""Stores for the contract suite: ``local`` (a folder) and ``s3`` (a real SeaweedFS on loopback)."""

from __future__ import annotations

import uuid

import pytest

from opentinker_common.artifacts import LocalArtifactStore, S3ArtifactStore, S3Location


@pytest.fixture
def s3_env(seaweedfs, monkeypatch):
    """The SeaweedFS credentials in this process's AWS environment (as an operator gives them)."""
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    return seaweedfs


@pytest.fixture
def s3_store(s3_env) -> S3ArtifactStore:
    """An S3 store on its own prefix of the session's bucket."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    return S3ArtifactStore(S3Location(bucket=s3_env.bucket, endpoint=s3_env.endpoint, prefix=prefix))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "artifacts")
    return request.getfixturevalue("s3_store")
