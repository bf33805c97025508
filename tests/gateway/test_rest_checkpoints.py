"""The Tinker REST routes for training runs and checkpoints through the unmodified SDK's
RestClient and the ``tinker`` CLI, with authentication on: an owner lists their own runs and
checkpoints a page at a time (an admin every owner's), downloads a checkpoint's files from URLs
that need no key or with ``tinker checkpoint download``, deletes a checkpoint by its tinker://
path (gone from every listing, loading it is 404, the artifact store no longer holds it) or gives
it a TTL after which the scheduler deletes it, and another owner's path is 404 like a missing one."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.support.gateway import MODEL_NAME, Gateway, auth_world, post
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """A scheduler with API keys on, one trainer, a gateway with a download URL secret, and the keys
    of alice, bob and the admin."""
    tmp = tmp_path_factory.mktemp("rest")
    secret = tmp / "download-url.secret"
    secret.write_text(secrets.token_hex(32))
    flags = ("--download-url-secret-file", str(secret))
    with auth_world(tmp, tiny_model_dir, *flags) as w:
        yield {
            "cluster": w.cluster,
            "url": w.gateway.url,
            "alice": w.alice,
            "bob": w.bob,
            "admin": w.admin,
            "tmp": tmp,
            "flags": flags,
        }


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def rest(world, who: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=world["url"], api_key=world[who])


def cli(world, who: str, *args: str) -> subprocess.CompletedProcess:
    """``tinker -f json ARGS`` as ``who``."""
    env = {**os.environ, "TINKER_BASE_URL": world["url"], "TINKER_API_KEY": world[who]}
    tinker_cli = str(Path(sys.executable).parent / "tinker")
    return subprocess.run([tinker_cli, "-f", "json", *args], env=env, capture_output=True, text=True, timeout=300)


def stored_keys(world, task_id: str) -> list[str]:
    """The artifact keys of the task's checkpoints in the local artifact store."""
    root = world["cluster"].state_dir / "artifacts" / "tasks" / task_id
    return sorted(str(p.relative_to(root.parent.parent)) for p in root.glob("a*/*")) if root.exists() else []


def stored_files(world, run: str, folder: str) -> dict[str, str]:
    """SHA-256 of every file of the run's checkpoint ``folder`` as the local artifact store holds it."""
    [root] = (world["cluster"].state_dir / "artifacts" / "tasks" / run).glob(f"a*/{folder}/.data")
    files = [p for p in root.rglob("*") if p.is_file()]
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def downloaded(world, who: str, path: str, *, via: str | None = None) -> dict[str, str] | int:
    """SHA-256 of every file of checkpoint ``path`` fetched from its download URLs (as the
    ``tinker`` CLI fetches them: urllib, no key), or the HTTP status of the refused request. With
    ``via``, another gateway's URL, the files are fetched from that gateway."""
    run, kind, name = path[len("tinker://") :].split("/")
    with httpx.Client(base_url=world["url"], timeout=60) as http:
        r = http.get(
            f"/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls",
            headers={"X-API-Key": world[who]},
        )
    if r.status_code != 200:
        return r.status_code
    answer = types.ExternalWeightsUrlsResponse.model_validate(r.json())
    assert answer.expires > datetime.now(timezone.utc)
    out = {}
    for file, url in answer.urls.items():
        try:
            with urllib.request.urlopen(url.replace(world["url"], via or world["url"]), timeout=60) as response:
                out[file] = hashlib.sha256(response.read()).hexdigest()
        except urllib.error.HTTPError as exc:
            return exc.code
    return out


def ended_run(world, who: str) -> str:
    """A training run of ``who`` whose session is finished at once (its task cancelled)."""
    session = f"{who}-{uuid.uuid4().hex[:8]}"
    body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL_NAME, "lora_config": {"rank": 2}}
    with httpx.Client(base_url=world["url"], timeout=120) as http:
        run = post(http, "create_model", world[who], json=body).json()["model_id"]
        assert post(http, f"sessions/{session}/finish", world[who], json={}).status_code == 200
    return run


def test_runs_and_checkpoints_listed_paged_and_deleted(world) -> None:
    with tinker.ServiceClient(base_url=world["url"], api_key=world["alice"]) as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        run = training.model_id
        kept = training.save_state("kept").result().path
        doomed = training.save_state("doomed").result().path
        sampler = training.save_weights_for_sampler("for-sampling", ttl_seconds=86400).result().path
        second, bobs = ended_run(world, "alice"), ended_run(world, "bob")
        alice = rest(world, "alice")

        # Runs: the caller's own, newest first, a page at a time; an admin sees every owner's.
        page = alice.list_training_runs(limit=1, offset=0).result()
        assert [r.training_run_id for r in page.training_runs] == [second]
        assert (page.cursor.total_count, page.cursor.limit, page.cursor.offset) == (2, 1, 0)
        page = alice.list_training_runs(limit=1, offset=1).result()
        assert [(r.training_run_id, r.base_model, r.lora_rank) for r in page.training_runs] == [(run, MODEL_NAME, 2)]
        everyone = {
            r.training_run_id for r in rest(world, "admin").list_training_runs(limit=100).result().training_runs
        }
        assert everyone >= {run, second, bobs}
        assert [r.training_run_id for r in rest(world, "bob").list_training_runs().result().training_runs] == [bobs]
        listed = json.loads(cli(world, "alice", "run", "list").stdout)
        assert [r["training_run_id"] for r in listed["runs"]] == [second, run]

        # Checkpoints across runs, newest first, a page at a time.
        saves = [sampler, doomed, kept]
        mine = wait_for(
            lambda: (r := alice.list_user_checkpoints(limit=2).result()).cursor.total_count == 3 and r,
            what="alice's three saves listed",
        )
        assert [c.tinker_path for c in mine.checkpoints] == saves[:2]
        assert [c.tinker_path for c in alice.list_user_checkpoints(limit=2, offset=2).result().checkpoints] == [kept]
        assert all(c.size_bytes > 0 for c in mine.checkpoints)
        assert rest(world, "bob").list_user_checkpoints().result().checkpoints == []
        assert [
            c["tinker_path"] for c in json.loads(cli(world, "alice", "checkpoint", "list").stdout)["checkpoints"]
        ] == saves

        # Download: a URL per file, fetched with no key; the files are the stored ones. Another
        # gateway with the same download URL secret serves the URLs too; one without it does not.
        assert downloaded(world, "alice", kept) == stored_files(world, run, "state_kept")
        assert downloaded(world, "bob", kept) == 404
        scheduler = f"127.0.0.1:{world['cluster'].port}"
        other, stranger = Gateway(world["tmp"], scheduler, *world["flags"]), Gateway(world["tmp"], scheduler)
        try:
            assert downloaded(world, "alice", kept, via=other.url) == stored_files(world, run, "state_kept")
            assert downloaded(world, "alice", kept, via=stranger.url) == 404
        finally:
            other.close()
            stranger.close()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{world['url']}/api/v1/checkpoint_files/not-a-token/adapter_config.json")
        assert refused.value.code == 404

        # Another owner's checkpoint is not found, worded as a missing one; nothing is deleted.
        with pytest.raises(tinker.NotFoundError) as refused:
            rest(world, "bob").delete_checkpoint_from_tinker_path(doomed).result()
        assert "no training run" in str(refused.value)
        before = stored_keys(world, run)
        assert len(before) == 3

        # The owner deletes it: from the store and from every listing; loading it is 404.
        done = cli(world, "alice", "checkpoint", "delete", "-y", doomed)
        assert json.loads(done.stdout) == {"deleted_count": 1, "failed": []}, done.stderr
        assert stored_keys(world, run) == [k for k in before if not k.endswith("/state_doomed")]
        assert [c.tinker_path for c in alice.list_checkpoints(run).result().checkpoints] == [kept, sampler]
        assert [c.tinker_path for c in alice.list_user_checkpoints().result().checkpoints] == [sampler, kept]
        with pytest.raises(tinker.NotFoundError) as gone:
            training.load_state(doomed).result()
        assert "was deleted" in str(gone.value)
        with pytest.raises(tinker.NotFoundError):
            alice.delete_checkpoint_from_tinker_path(doomed).result()  # a second time: not found

        # An expiry, set with the save or afterwards, shows in the listings; the scheduler deletes the
        # checkpoint when it comes.
        def expiries():
            return {c.tinker_path: c.expires_at for c in alice.list_checkpoints(run).result().checkpoints}

        in_a_day = wait_for(lambda: expiries()[sampler], what="the sampler save's ttl_seconds set")
        assert 86000 < (in_a_day - datetime.now(timezone.utc)).total_seconds() <= 86400
        alice.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
        assert 3500 < (expiries()[kept] - datetime.now(timezone.utc)).total_seconds() <= 3600
        with pytest.raises(tinker.BadRequestError) as refused:
            alice.set_checkpoint_ttl_from_tinker_path(kept, 0).result()
        assert "ttl_seconds: expected an integer in 1.." in str(refused.value)
        with pytest.raises(tinker.NotFoundError):
            rest(world, "bob").set_checkpoint_ttl_from_tinker_path(kept, 1).result()
        assert cli(world, "alice", "checkpoint", "set-ttl", "--ttl", "1", sampler).returncode == 0
        wait_for(
            lambda: [c.tinker_path for c in alice.list_user_checkpoints().result().checkpoints] == [kept],
            what="the sampler save deleted once its 1 s TTL passed",
        )
        assert stored_keys(world, run) == [k for k in before if k.endswith("/state_kept")]
        with pytest.raises(tinker.NotFoundError):
            alice.get_training_run(bobs).result()

    # tinker checkpoint download of a save_state path starts a training client from it, exports its
    # adapter with save_weights_external, fetches the export's files and deletes the export.
    out = world["tmp"] / "downloads"
    done = cli(world, "alice", "checkpoint", "download", kept, "--output", str(out))
    assert done.returncode == 0, done.stderr
    folder = out / kept[len("tinker://") :].replace("/", "_")
    assert {p.name for p in folder.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    [state] = (world["cluster"].state_dir / "artifacts" / "tasks" / run).glob("a*/state_kept/.data")
    got, saved = (load_file(str(f / "adapter_model.safetensors")) for f in (folder, state))
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 2
    assert [c.tinker_path for c in alice.list_user_checkpoints().result().checkpoints] == [kept]
    refused = cli(world, "bob", "checkpoint", "download", kept, "--output", str(out / "bob"))
    assert refused.returncode != 0 and "no state" in refused.stderr


def test_bad_checkpoint_paths_and_publish_are_refused_naming_the_field(world) -> None:
    http = httpx.Client(base_url=world["url"], timeout=60)
    key = {"X-API-Key": world["alice"]}
    r = http.delete("/api/v1/training_runs/some-run/checkpoints/elsewhere/x", headers=key)
    assert r.status_code == 400 and r.json()["detail"].startswith("checkpoint_id: expected tinker://")
    r = http.delete("/api/v1/training_runs/no-such-run/checkpoints/weights/x", headers=key)
    assert r.status_code == 404 and "no training run 'no-such-run'" in r.json()["detail"]
    r = http.get("/api/v1/training_runs", params={"limit": 0}, headers=key)
    assert r.status_code == 400 and r.json()["detail"].startswith("limit: expected an integer in 1..1000")
    r = http.get("/api/v1/checkpoints", params={"offset": -1}, headers=key)
    assert r.status_code == 400 and r.json()["detail"].startswith("offset: expected an integer >= 0")
    with pytest.raises(tinker.BadRequestError) as refused:
        rest(world, "alice").publish_checkpoint_from_tinker_path("tinker://r/weights/x").result()
    assert "not served" in str(refused.value)
