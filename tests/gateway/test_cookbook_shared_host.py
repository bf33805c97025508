"""Two tinker-cookbook runs at once share one model host: the trainer's ``--tenants-per-host``
host holds both Tinker models as tenants of one base model, and each run's per-step train NLL
equals the same run alone. A tenant's calls run in its turn on the host, between its neighbour's,
never batched with them, so the curves are equal, not merely close. Four short runs of chat_sl
(two steps of four conversations, on the tiny model): the cost is the runs' start, not their steps."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from opentinker_client import RLClient
from tests.gateway.conftest import CONFIG
from tests.support.gateway import MODEL_NAME, Gateway, hf_cache, model_names
from tests.support.procs import Cluster, Proc
from tests.support.waiting import wait_for

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (make install)")

import tinker_cookbook  # noqa: E402

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
#: Two runs that differ after their first step: the same data, other learning rates.
RUNS = {"slow": "1e-3", "fast": "5e-3"}
STEPS = 2


@pytest.fixture
def world(tmp_path, tiny_model_dir):
    """A scheduler, a trainer whose model host takes two tenants, a gateway serving the tiny model
    as :data:`MODEL_NAME`, and the cookbook's environment for it (offline)."""
    cluster = Cluster(tmp_path, CONFIG + model_names(tiny_model_dir))
    gateway = None
    try:
        cluster.start_scheduler()
        cluster.start_trainer("node-a", "--tenants-per-host", "2")
        cluster.wait_nodes(1)
        gateway = Gateway(tmp_path, f"127.0.0.1:{cluster.port}")
        env = {
            "TINKER_BASE_URL": gateway.url,
            "TINKER_API_KEY": "tml-anything",
            "TINKER_TELEMETRY": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(hf_cache(tmp_path / "hub", tiny_model_dir)),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        with RLClient(cluster.url) as client:
            yield tmp_path, env, client
    finally:
        if gateway is not None:
            gateway.close()
        cluster.close()


def _start(tmp: Path, env: dict, run: str, phase: str) -> tuple[Proc, Path]:
    log_path = tmp / f"{phase}-{run}"
    proc = Proc(
        [
            "-m",
            "tinker_cookbook.recipes.chat_sl.train",
            f"model_name={MODEL_NAME}",
            "renderer_name=qwen3_instruct",
            f"log_path={log_path}",
            f"dataset={CONVERSATIONS}",
            "batch_size=4",
            f"max_steps={STEPS}",
            "max_length=128",
            "lora_rank=8",
            f"learning_rate={RUNS[run]}",
            "save_every=0",
            "eval_every=0",
            "infrequent_eval_every=0",
        ],
        tmp / f"{phase}-{run}.log",
        env=env,
        cwd=tmp,
    )
    return proc, log_path


def _nll(proc: Proc, log_path: Path, what: str) -> list[float]:
    assert proc.wait_exit(what=what) == 0, proc.log_text()[-6000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == STEPS, rows
    return nll


def _tenants(client: RLClient) -> list[tuple[str, ...]]:
    """The tenants of each model host that has some."""
    return [h.task_ids for n in client.list_nodes() for h in n.model_hosts if h.task_ids]


def _hosts_while(client: RLClient, procs: list[Proc]) -> list[list[tuple[str, ...]]]:
    """What :func:`_tenants` shows, read again and again until every one of ``procs`` exited."""
    seen = []
    while any(p.popen.poll() is None for p in procs):
        seen.append(_tenants(client))
        time.sleep(0.2)
    return seen


def test_two_runs_share_one_model_host_each_with_its_own_curve(world) -> None:
    tmp, env, client = world
    started = {run: _start(tmp, env, run, "together") for run in RUNS}
    seen = _hosts_while(client, [proc for proc, _ in started.values()])
    together = {run: _nll(*started[run], f"run {run} beside the other") for run in RUNS}
    sessions = {t.task_id for t in client.list_tasks(limit=None) if t.name.startswith("tinker ")}
    assert len(sessions) == 2 and all(len(hosts) <= 1 for hosts in seen), seen
    assert [sessions] == [set(hosts[0]) for hosts in seen if hosts and len(hosts[0]) == 2][:1], seen

    for run in RUNS:
        wait_for(lambda: not _tenants(client), what="the model host holds no tenant")
        proc, log_path = _start(tmp, env, run, "alone")
        seen = _hosts_while(client, [proc])
        alone = _nll(proc, log_path, f"run {run} alone")
        assert all(len(hosts) <= 1 and len(hosts[0]) == 1 for hosts in seen if hosts), seen
        assert together[run] == alone, (run, together[run], alone)
    assert together["slow"][1:] != together["fast"][1:]  # two runs, not one run twice
