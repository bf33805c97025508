"""tinker-cookbook 0.6.1 trains, unmodified, on OpenTinker: its chat_sl and math_rl recipes run as
``python -m`` against a real scheduler, trainer and gateway on loopback with SmolLM2-135M-Instruct,
offline. The curves the recipes write to their metrics.jsonl show that they learn."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest

from tests.support.gateway import MODEL_NAME, Gateway, hf_cache
from tests.support.procs import Proc

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (make install)")

import tinker_cookbook  # noqa: E402

#: The cookbook's own example conversations, shipped in its wheel.
CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


@pytest.fixture
def model_dir(real_model_dir):
    """The cookbook trains the real model: the scheduler maps the Tinker model name to it."""
    return real_model_dir


@pytest.fixture
def cookbook(tmp_path, cluster, real_model_dir):
    """Runs a cookbook recipe against a gateway on the cluster; returns its metrics.jsonl rows."""
    gateway = Gateway(tmp_path, f"127.0.0.1:{cluster.port}")
    env = {
        "TINKER_BASE_URL": gateway.url,
        "TINKER_API_KEY": "tml-anything",
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hf_cache(tmp_path / "hub", real_model_dir)),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }

    def run(recipe: str, *args: str) -> tuple[list[dict], list[dict]]:
        """The rows of the run's metrics.jsonl and of its checkpoints.jsonl."""
        log_path = tmp_path / recipe.rsplit(".", 2)[-2]
        proc = Proc(
            ["-m", recipe, f"model_name={MODEL_NAME}", "renderer_name=qwen3_instruct", f"log_path={log_path}", *args],
            tmp_path / f"{log_path.name}.log",
            env=env,
            cwd=tmp_path,
        )
        assert proc.wait_exit(what=recipe) == 0, proc.log_text()[-6000:]
        return tuple(
            [json.loads(line) for line in (log_path / name).read_text().splitlines()]
            for name in ("metrics.jsonl", "checkpoints.jsonl")
        )

    yield run
    gateway.close()


def test_chat_sl_learns(cookbook) -> None:
    rows, saves = cookbook(
        "tinker_cookbook.recipes.chat_sl.train",
        f"dataset={CONVERSATIONS}",
        "num_epochs=2",
        "batch_size=32",
        "max_length=128",
        "lora_rank=8",
        "learning_rate=1e-3",
        "save_every=0",
        "eval_every=0",
    )
    assert [s["name"] for s in saves] == ["final"] and saves[0]["state_path"].startswith("tinker://"), saves
    nll = {
        epoch: [r["train_mean_nll"] for r in rows if r.get("epoch") == epoch and "train_mean_nll" in r]
        for epoch in (0, 1)
    }
    assert len(nll[0]) == len(nll[1]) == 4, rows
    assert statistics.mean(nll[1]) < statistics.mean(nll[0]), nll


def test_math_rl_learns_with_its_default_loss(cookbook) -> None:
    """math_rl's default loss is stable_reinforce: the sampler records its samples and each datum
    names them (provenance)."""
    rows, _ = cookbook(
        "tinker_cookbook.recipes.math_rl.train",
        "env=arithmetic",
        "group_size=4",
        "groups_per_batch=8",
        "max_tokens=3",
        "lora_rank=8",
        "learning_rate=1e-3",
        "max_steps=6",
        "save_every=4",
        "eval_every=0",
    )
    reward = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    assert len(reward) == 6, rows
    assert statistics.mean(reward[-2:]) > reward[0], reward
