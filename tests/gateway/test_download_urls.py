"""A download URL's token opens under the secret that sealed it, until it expires; a changed one,
another secret's and a too-short secret file are refused. That any gateway instance with the
secret serves another's URLs is tests/gateway/test_rest_checkpoints.py's."""

from __future__ import annotations

import pytest

from opentinker_gateway.download_urls import Download, DownloadUrls
from opentinker_gateway.errors import ApiError


def refused(urls: DownloadUrls, token: str, now: float) -> int:
    with pytest.raises(ApiError) as exc:
        urls.open(token, now=now)
    return exc.value.status


def test_a_token_opens_until_it_expires_under_its_own_secret_only(tmp_path) -> None:
    secret = tmp_path / "download-url.secret"
    secret.write_text("s" * 40 + "\n")
    urls = DownloadUrls.from_file(secret)
    download = Download("key", "task-1", "tasks/task-1/a1/state_kept", expires=1000.0)
    token = urls.seal(download)
    assert urls.open(token, now=999.0) == download
    assert DownloadUrls.from_file(secret).open(token, now=999.0) == download  # another instance, the same file
    assert refused(urls, token, now=1000.0) == 404
    assert refused(DownloadUrls.random(), token, now=0.0) == 404
    changed = token[:10] + ("A" if token[10] != "A" else "B") + token[11:]
    assert refused(urls, changed, now=0.0) == 404
    assert refused(urls, "not-a-token", now=0.0) == 404
    secret.write_text("too short")
    with pytest.raises(ValueError, match="expected at least 32 bytes"):
        DownloadUrls.from_file(secret)
