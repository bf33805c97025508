"""``scripts/bench_grpo_trl.py`` smoke runs, without the TRL venv: OpenTinker's side for real on
the tiny model through a scheduler and a trainer, the peer as a stand-in interpreter that records
what it was given and answers as ``scripts/peer_trl_grpo.py`` does. No timing is asserted:
BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Answers like the TRL peer: steps end 3 s apart, reward 0.25 then 0.75 from step 3 on; records
#: its config, its session and its parent's, and OMP_NUM_THREADS.
FAKE_PEER = """#!{python}
import json, os, sys
cfg = json.loads(sys.argv[sys.argv.index("--config") + 1])
with open({record!r}, "a") as f:
    rec = {{"cfg": cfg, "sid": os.getsid(0), "parent_sid": os.getsid(os.getppid()),
            "omp": os.environ.get("OMP_NUM_THREADS")}}
    f.write(json.dumps(rec) + "\\n")
steps = [{{"step": i + 1, "end_s": 1.0 + 3.0 * i, "reward": 0.25 if i < 2 else 0.75}} for i in range(cfg["steps"])]
print(json.dumps({{"steps": steps, "build_s": 0.1, "versions": {{"trl": "fake"}},
                  "gradient_checkpointing": False, "dtype": "torch.float32"}}))
"""


def fake_peer(tmp_path: Path) -> tuple[Path, Path]:
    record = tmp_path / "peer_calls.jsonl"
    python = tmp_path / "peer-python"
    python.write_text(FAKE_PEER.format(python=sys.executable, record=str(record)))
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python, record


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_grpo_trl.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ours_through_the_services_and_the_peer_give_the_ratio(tiny_model_dir, tmp_path) -> None:
    python, record = fake_peer(tmp_path)
    out = tmp_path / "bench.json"
    absent_venv = tmp_path / "no-venv"
    args = ["--model", str(tiny_model_dir), "--steps", "2", "--repeats", "1", "--json", str(out)]
    args += ["--peer-python", str(python), "--peer-venv", str(absent_venv), "--work-dir", str(tmp_path / "w")]
    proc = bench(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not absent_venv.exists(), "--peer-python given: no venv is made"
    res = json.loads(out.read_text())
    ours, trl = res["runs"]
    assert (ours["key"], trl["key"]) == ("opentinker", "trl")  # repeat 1: ours first
    assert len(ours["rewards"]) == 2 and len(ours["step_s"]) == 1 and ours["s_per_step"] > 0
    assert res["summary"]["opentinker"]["worker_s_per_step"] > 0  # perf/step_s, inside the worker
    assert trl["s_per_step"] == 3.0 and trl["reward_first3"] == 0.25
    assert res["ratio_trl_over_ours"] == 3.0 / res["summary"]["opentinker"]["s_per_step"]
    assert "TRL s/step over OpenTinker s/step" in proc.stdout
    # The peer got the one settings dict, with the problems OpenTinker's env draws for seed 0.
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert {k: call["cfg"][k] for k in res["settings"]} == res["settings"]
    assert len(call["cfg"]["problems"]) == 2 * res["settings"]["prompts_per_step"]


def test_the_peer_runs_in_its_own_session_with_one_thread_and_each_repeat_has_its_seed(tmp_path) -> None:
    python, record = fake_peer(tmp_path)
    model = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
    if not (model / "config.json").exists():
        model = tmp_path / "model"  # only config.json is read on the bench's side
        model.mkdir()
        (model / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_grpo_trl.py"), "--only", "trl", "--model", str(model)]
        + ["--steps", "3", "--repeats", "2", "--seed", "5", "--peer-python", str(python)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [c["cfg"]["seed"] for c in calls] == [5, 6]
    assert all(c["sid"] != c["parent_sid"] for c in calls), "the peer runs in a session of its own"
    assert all(c["omp"] == "1" for c in calls)
    assert calls[0]["cfg"]["problems"] != calls[1]["cfg"]["problems"]  # drawn with each repeat's seed
    assert "TRL s/step over" not in proc.stdout  # one side: no ratio


def test_fewer_than_two_steps_is_refused_naming_the_option(tmp_path) -> None:
    proc = bench("--only", "opentinker", "--steps", "1", "--peer-venv", str(tmp_path / "v"))
    assert proc.returncode == 2
    assert "--steps: at least 2" in proc.stderr
    assert not (tmp_path / "v").exists()
