"""S3 faults against a real server: wrong credentials, no credentials, an endpoint nobody serves."""

from __future__ import annotations

import time

import pytest

from opentinker_common.artifacts import S3ArtifactStore, S3Location, StoreAuthError, StoreUnavailable
from tests.support.procs import free_port


def test_wrong_secret_is_a_clear_error_without_the_secret(seaweedfs, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-xyz-123")
    store = S3ArtifactStore(S3Location(bucket=seaweedfs.bucket, endpoint=seaweedfs.endpoint))
    with pytest.raises(StoreAuthError) as err:
        store.check()
    msg = str(err.value)
    assert "refused the credentials" in msg and "SignatureDoesNotMatch" in msg
    assert "wrong-secret-xyz-123" not in msg and seaweedfs.secret_key not in msg
    assert seaweedfs.access_key not in msg  # only its first characters
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"1")
    with pytest.raises(StoreAuthError):
        store.put_folder("k/x", tmp_path / "src")


def test_unknown_access_key_is_refused(seaweedfs, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "whatever-secret")
    with pytest.raises(StoreAuthError, match="InvalidAccessKeyId"):
        S3ArtifactStore(S3Location(bucket=seaweedfs.bucket, endpoint=seaweedfs.endpoint)).check()


def test_no_credentials_says_which_variables(monkeypatch, tmp_path, seaweedfs):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreAuthError, match="AWS_ACCESS_KEY_ID"):
        S3ArtifactStore(S3Location(bucket=seaweedfs.bucket, endpoint=seaweedfs.endpoint)).check()


def test_unreachable_endpoint_is_named(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    endpoint = f"http://127.0.0.1:{free_port()}"
    store = S3ArtifactStore(S3Location(bucket="b", endpoint=endpoint), connect_timeout_s=1, max_attempts=1)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"S3 endpoint {endpoint} unreachable"):
        store.check()
    assert time.monotonic() - started < 10


def test_missing_bucket_is_named(s3_env):
    store = S3ArtifactStore(S3Location(bucket="no-such-bucket-here", endpoint=s3_env.endpoint))
    with pytest.raises(StoreUnavailable, match="no-such-bucket-here"):
        store.check()
