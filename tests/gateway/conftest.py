from __future__ import annotations

import pytest

from tests.support.gateway import Gateway, hf_cache, model_names
from tests.support.procs import Cluster

CONFIG = """heartbeat_interval: 0.5
lease: 3
workload_types:
  - type: lora_session
    priority: 3
"""


@pytest.fixture
def model_dir(tiny_model_dir):
    """The folder the scheduler's ``model_names:`` maps the tests' Tinker model name to."""
    return tiny_model_dir


@pytest.fixture
def cluster(tmp_path, model_dir):
    """A scheduler serving :data:`~tests.support.gateway.MODEL_NAME` from ``model_dir`` and one
    trainer on loopback (authentication off)."""
    c = Cluster(tmp_path, CONFIG + model_names(model_dir))
    try:
        c.start_with_trainer()
        yield c
    finally:
        c.close()


@pytest.fixture
def sdk_env(monkeypatch, tmp_path, model_dir):
    """The SDK's environment: offline, no telemetry, a Hugging Face cache of its own that holds the
    tokenizer under its hub id; returns a function that points it at a gateway."""
    import huggingface_hub.constants

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads its environment on import, which came before this fixture.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_cache(tmp_path / "hub", model_dir)))
    monkeypatch.setenv("TINKER_API_KEY", "tml-anything")

    def point(gateway: Gateway) -> None:
        monkeypatch.setenv("TINKER_BASE_URL", gateway.url)

    return point


@pytest.fixture
def gateway_factory(tmp_path, cluster):
    """Start gateways on the cluster's scheduler; all closed at the end."""
    started: list[Gateway] = []

    def start(*extra: str, port: int | None = None) -> Gateway:
        g = Gateway(tmp_path, f"127.0.0.1:{cluster.port}", *extra, port=port)
        started.append(g)
        return g

    yield start
    for g in started:
        g.close()
