"""A checkpoint's download URLs work on any gateway instance that shares the URL secret: one
instance makes them, another serves the files, with authentication on. An instance without that
secret, a changed token and an expired one are refused with 404."""

from __future__ import annotations

import hashlib
import secrets
import urllib.error
import urllib.request

import httpx
import pytest
import tinker

from tests.support.gateway import MODEL_NAME, Gateway, auth_world
from tests.support.waiting import wait_for


def fetch(url: str) -> str | int:
    """SHA-256 of the file at ``url``, fetched with no key as the ``tinker`` CLI does, or the HTTP
    status of the refusal."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return hashlib.sha256(response.read()).hexdigest()
    except urllib.error.HTTPError as exc:
        return exc.code


def test_urls_of_one_instance_download_from_another(tmp_path, tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    secret = tmp_path / "download-url.secret"
    secret.write_text(secrets.token_hex(32))
    flags = ("--download-url-secret-file", str(secret))
    with auth_world(tmp_path, tiny_model_dir, *flags) as world:
        scheduler = f"127.0.0.1:{world.cluster.port}"
        other, stranger = Gateway(tmp_path, scheduler, *flags), Gateway(tmp_path, scheduler)
        try:
            with tinker.ServiceClient(base_url=world.gateway.url, api_key=world.alice) as service:
                training = service.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
                path = training.save_state("kept").result().path
            rest = tinker.RestClient(base_url=world.gateway.url, api_key=world.alice)
            wait_for(
                lambda: path in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints],
                what=f"{path} listed",
            )
            run, kind, name = path[len("tinker://") :].split("/")
            with httpx.Client(base_url=world.gateway.url, timeout=60) as http:
                r = http.get(
                    f"/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls",
                    headers={"X-API-Key": world.alice},
                )
            assert r.status_code == 200, r.text
            urls = r.json()["urls"]
            assert set(urls) >= {"adapter_config.json", "adapter_model.safetensors"}
            [stored] = (world.cluster.state_dir / "artifacts" / "tasks" / run).glob(f"a*/state_{name}/.data")
            expected = {f: hashlib.sha256((stored / f).read_bytes()).hexdigest() for f in urls}

            # The instance that made the URLs and another one with the same secret serve the files.
            assert {f: fetch(u) for f, u in urls.items()} == expected
            assert {f: fetch(u.replace(world.gateway.url, other.url)) for f, u in urls.items()} == expected

            # An instance with another secret, and a changed token, are refused.
            url = urls["adapter_config.json"]
            assert fetch(url.replace(world.gateway.url, stranger.url)) == 404
            token = url.split("/checkpoint_files/")[1].split("/")[0]
            changed = token[:10] + ("A" if token[10] != "A" else "B") + token[11:]
            assert fetch(url.replace(token, changed).replace(world.gateway.url, other.url)) == 404
        finally:
            other.close()
            stranger.close()


def test_a_token_opens_until_it_expires_and_under_its_own_secret_only(tmp_path) -> None:
    from opentinker_gateway.download_urls import Download, DownloadUrls
    from opentinker_gateway.errors import ApiError

    urls = DownloadUrls.random()
    download = Download("key", "task-1", "tasks/task-1/a1/state_kept", expires=1000.0)
    token = urls.seal(download)
    assert urls.open(token, now=999.0) == download
    for refused in (lambda: urls.open(token, now=1000.0), lambda: DownloadUrls.random().open(token, now=0.0)):
        with pytest.raises(ApiError) as exc:
            refused()
        assert exc.value.status == 404
    short = tmp_path / "short.secret"
    short.write_text("too short")
    with pytest.raises(ValueError, match="expected at least 32 bytes"):
        DownloadUrls.from_file(short)
