"""The scheduler's artifact store: the ``artifacts:`` config, refusing to start without the store,
retention (newest N plus the final one), DownloadCheckpoint from the store."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from opentinker_common.artifacts import LocalArtifactStore
from opentinker_scheduler.config import ConfigError, SchedulerConfig, parse_config
from opentinker_scheduler.config.artifacts import ArtifactsConfig
from opentinker_scheduler.data.artifact_store import ArtifactStartError, Artifacts, open_artifact_store, retention_plan
from opentinker_scheduler.server import start_scheduler
from tests.support.procs import free_port


def test_the_default_is_local_under_the_state_dir(tmp_path):
    cfg = parse_config("state_dir: s\n", base_dir=tmp_path)
    assert cfg.artifacts == ArtifactsConfig()
    store = open_artifact_store(cfg)
    assert isinstance(store, LocalArtifactStore) and store.root == tmp_path / "s" / "artifacts"


def test_an_s3_section_is_parsed():
    cfg = parse_config(
        "artifacts:\n  backend: s3\n  keep_checkpoints: 5\n"
        "  s3: {endpoint: 'http://s3.local:8333/', bucket: ot-ckpt, prefix: team-a, region: eu-west-1}\n"
    )
    a = cfg.artifacts
    assert a.backend == "s3" and a.keep_checkpoints == 5
    assert (a.s3.endpoint, a.s3.bucket, a.s3.prefix, a.s3.region) == (
        "http://s3.local:8333",
        "ot-ckpt",
        "team-a/",
        "eu-west-1",
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("artifacts: {backend: nfs}", "test.yaml:1:22: artifacts.backend: expected local or s3, got 'nfs'"),
        ("artifacts: {backend: s3}", "artifacts.s3: expected an s3: section"),
        ("artifacts: {backend: s3, s3: {endpoint: 'http://x:1'}}", "artifacts.s3.bucket: expected a bucket name"),
        ("artifacts: {backend: s3, s3: {bucket: Bad_Bucket}}", "artifacts.s3.bucket: expected an S3 bucket name"),
        ("artifacts: {backend: s3, s3: {bucket: b1b, endpoint: 'ftp://x'}}", "artifacts.s3.endpoint: expected http(s)"),
        ("artifacts: {backend: s3, s3: {bucket: b1b, secret_key: x}}", "artifacts.s3.secret_key: expected one of"),
        ("artifacts: {keep_checkpoints: 0}", "artifacts.keep_checkpoints: expected an integer in [1, 1000]"),
        (
            "artifacts: {backend: s3, s3: {bucket: b1b, presign_expires_s: 0}}",
            "artifacts.s3.presign_expires_s: expected an integer in [1, 43200], got 0",
        ),
        (
            "artifacts: {backend: s3, s3: {bucket: b1b, multipart_part_bytes: 1048576}}",
            "artifacts.s3.multipart_part_bytes: expected an integer in [5242880, 5368709120], got 1048576",
        ),
        ("artifacts: {s3: {bucket: b1b}}", "artifacts.s3: expected no s3: section with backend: local"),
    ],
)
def test_bad_artifacts_sections_are_refused_with_the_line(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text, "test.yaml")
    assert message in str(err.value)


def test_the_scheduler_refuses_to_start_when_s3_is_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    endpoint = f"http://127.0.0.1:{free_port()}"
    cfg = parse_config(f"artifacts: {{backend: s3, s3: {{endpoint: '{endpoint}', bucket: ckpt}}}}")
    cfg = replace(cfg, state_dir=tmp_path / "state")
    with pytest.raises(ArtifactStartError, match=f"S3 endpoint {endpoint} unreachable"):
        asyncio.run(start_scheduler(cfg, host="127.0.0.1", port=0, http_port=None))
    # and the state dir is free again (the store was closed)
    asyncio.run(_start_stop(replace(SchedulerConfig(), state_dir=tmp_path / "state")))


async def _start_stop(cfg):
    running = await start_scheduler(cfg, host="127.0.0.1", port=0, http_port=None)
    await running.stop(0)


def test_wrong_s3_credentials_stop_the_start_without_the_secret(seaweedfs, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-4711")
    cfg = parse_config(
        f"artifacts: {{backend: s3, s3: {{endpoint: '{seaweedfs.endpoint}', bucket: {seaweedfs.bucket}}}}}"
    )
    with pytest.raises(ArtifactStartError) as err:
        open_artifact_store(replace(cfg, state_dir=tmp_path))
    assert "refused the credentials" in str(err.value) and "not-the-secret-4711" not in str(err.value)


def test_retention_keeps_the_newest_n_and_every_final():
    keys = [f"tasks/t1/a1/step_{s}" for s in (10, 20, 30)] + ["tasks/t1/a2/step_40", "tasks/t1/a2/step_30"]
    keys += ["tasks/t1/a2/final_50", "tasks/t2/a1/step_5", "datasets/x"]
    assert retention_plan(keys, 3) == ["tasks/t1/a1/step_10", "tasks/t1/a1/step_20"]
    assert retention_plan(keys, 1) == [
        "tasks/t1/a1/step_10",
        "tasks/t1/a1/step_20",
        "tasks/t1/a1/step_30",
        "tasks/t1/a2/step_30",
    ]


def test_retention_deletes_from_the_store(tmp_path):
    store = LocalArtifactStore(tmp_path / "a")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"1")
    for step in (10, 20, 30, 40, 50):
        store.put_folder(f"tasks/t1/a1/step_{step}", tmp_path / "src")
    store.put_folder("tasks/t1/a1/final_60", tmp_path / "src")
    arts = Artifacts(store, ArtifactsConfig(keep_checkpoints=2))
    assert arts.apply_retention("t1") == ["tasks/t1/a1/step_10", "tasks/t1/a1/step_20", "tasks/t1/a1/step_30"]
    assert store.list() == ["tasks/t1/a1/final_60", "tasks/t1/a1/step_40", "tasks/t1/a1/step_50"]
