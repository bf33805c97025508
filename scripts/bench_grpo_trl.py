#!/usr/bin/env python3
"""GRPO with LoRA through OpenTinker's service path against TRL's ``GRPOTrainer``, like for like.

Both sides train a LoRA adapter on the same model folder with the same settings (:data:`SETTINGS`,
defined once here and given to both), the same seed and the same arithmetic problems in the same
order (one digit, "What is a + b?", drawn by the ``arithmetic`` env's seeded RNG), scored by the
same :func:`opentinker_common.arithmetic.reward`.

* OpenTinker: a scheduler and one trainer node on loopback, started as ``make demo`` starts them
  (each in its own session), a ``lora_finetune`` task submitted with the client, its metrics
  watched over gRPC. A step's time is the interval between two step metrics reaching the client.
* TRL: ``scripts/peer_trl_grpo.py`` in the peer venv's interpreter, in its own session. A step's
  time is the interval between two ``on_step_end`` callbacks.

This kernel shares the CPU per session (sched_autogroup), so each side runs alone in its own
sessions, one after the other, in ABBA order over repeats: repeat 1 runs ours then TRL, repeat 2
TRL then ours, and so on; repeat ``r`` uses seed ``--seed + r - 1`` on both sides. Every process
runs with ``OMP_NUM_THREADS=1``. Per side: seconds per step, the median over every run's steps
after the first (the first holds warm-up); the mean reward of the first 3 and the last 3 steps,
averaged over runs; and the ratio TRL s/step over ours.

    .venv/bin/python scripts/bench_grpo_trl.py                     # 12 steps, 2 repeats (make bench-grpo-trl)
    .venv/bin/python scripts/bench_grpo_trl.py --only opentinker --steps 3 --repeats 1

The peer venv (``--peer-venv``, default ``.cache/peer-venv``) is made when missing:
``python3 -m venv``, then torch at the pin of ``constraints.txt``, then transformers and peft at
their pins and ``trl==1.16.0``. ``--peer-python`` names another interpreter instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import demo  # noqa: E402  (process launching helpers of `make demo`)
from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)
from opentinker_common.arithmetic import ArithmeticEnv  # noqa: E402
from opentinker_common.spec import ArithmeticEnvConfig  # noqa: E402
from opentinker_common.spec.lm_fields import DEFAULT_TARGET_MODULES  # noqa: E402

PEER_SCRIPT = ROOT / "scripts" / "peer_trl_grpo.py"
TRL_VERSION = "1.16.0"

#: Both sides' settings. GRPOConfig's defaults, the reward scaled by the group's std, the loss
#: averaged over the batch's tokens (TRL's ``dapo``), AdamW betas (0.9, 0.999), eps 1e-8, constant
#: learning rate, float32, top_p 1. ``kl_coef`` is TRL's ``beta``; ``ppo_epochs`` its ``num_iterations``.
SETTINGS: dict = {
    "steps": 12,
    "prompts_per_step": 4,
    "group_size": 8,
    "ppo_epochs": 1,
    "max_new_tokens": 10,
    "temperature": 0.7,
    "learning_rate": 5e-4,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "clip_eps": 0.2,
    "kl_coef": 0.0,
    "lora_rank": 16,
    "lora_alpha": 32.0,
    "lora_dropout": 0.0,
    "target_modules": list(DEFAULT_TARGET_MODULES),
    "min_digits": 1,
    "max_digits": 1,
}

#: OpenTinker's hyper-parameters that say what TRL does by default or by the peer's settings.
OURS_FIXED = {
    "scale_rewards": True,
    "loss_aggregation": "token_mean",
    "top_p": 1.0,
    "dtype": "float32",
    "micro_batch_size": 0,
    "checkpoint_every": 0,
}
_GRPO_KEYS = (
    "steps", "prompts_per_step", "group_size", "ppo_epochs", "max_new_tokens", "temperature", "learning_rate",
    "weight_decay", "max_grad_norm", "clip_eps", "kl_coef", "lora_rank", "lora_alpha", "lora_dropout",
    "target_modules",
)  # fmt: skip

THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def problems(settings: dict, seed: int) -> list[list[int]]:
    """The ``[a, b]`` of every step's problems, in order, as OpenTinker's ``arithmetic`` env with
    ``seed`` draws them (``prompts_per_step`` per step)."""
    config = ArithmeticEnvConfig(min_digits=settings["min_digits"], max_digits=settings["max_digits"], seed=seed)
    drawn = ArithmeticEnv(config).sample(settings["steps"] * settings["prompts_per_step"])
    return [[p.a, p.b] for p in drawn]


def summarise(side: str, step_rewards: list[float], ends: list[float]) -> dict:
    """One run's figures from its per-step rewards and step end times (seconds)."""
    intervals = [b - a for a, b in zip(ends, ends[1:])]
    k = min(3, len(step_rewards))
    return {
        "side": side,
        "rewards": step_rewards,
        "step_s": intervals,
        "s_per_step": statistics.median(intervals) if intervals else float("nan"),
        "reward_first3": sum(step_rewards[:k]) / k if k else float("nan"),
        "reward_last3": sum(step_rewards[-k:]) / k if k else float("nan"),
    }


# --- OpenTinker ---------------------------------------------------------------------------------
def run_ours(model: Path, settings: dict, seed: int, work: Path) -> dict:
    """One ``lora_finetune`` task through a fresh scheduler and trainer node on loopback."""
    from opentinker_client import RLClient

    work.mkdir(parents=True)
    port, http_port = demo.free_port(0), demo.free_port(0)
    config = work / "scheduler_config.yaml"
    config.write_text(
        "resource_pool:\n  - node_id: bench-node\n    gpu_count: 0\n    max_tasks: 1\n"
        "workload_types:\n  - type: lora_finetune\n    priority: 1\n"
        f"state_dir: {work / 'state'}\n"
    )
    hp = {**{k: settings[k] for k in _GRPO_KEYS}, **OURS_FIXED, "seed": seed}
    env_config = {"env_id": "arithmetic", "min_digits": settings["min_digits"], "max_digits": settings["max_digits"]}
    env_config["seed"] = seed
    procs: list = []
    client = None
    try:
        env = {"OPENTINKER_LOG_FORMAT": "json", **THREADS}
        demo.start_scheduler(config, port, http_port, work / "scheduler.log", env, procs)
        url = f"127.0.0.1:{port}"
        trainer = demo.start_trainer("bench-node", work / "runs", url, work / "trainer.log", env, procs)
        client = RLClient(scheduler_url=url, min_poll_interval=0)
        demo.wait_node(client, trainer, work / "trainer.log", timeout=120)
        task_id = client.submit_task(
            workload_type="lora_finetune",
            model=str(model),
            env_config=env_config,
            gpu_count=0,
            hyperparameters=hp,
        )
        rewards, ends, worker_step_s = [], [], []
        for ev in client.watch(task_id):
            if ev.kind == "metric" and "reward" in ev.metrics:
                ends.append(time.perf_counter())
                rewards.append(float(ev.metrics["reward"]))
                worker_step_s.append(float(ev.metrics.get("perf/step_s", float("nan"))))
                print(f"  ours step {ev.step}: reward {rewards[-1]:.3f}", flush=True)
        task = client.get_task(task_id)
        if task.state != "succeeded":
            raise SystemExit(f"OpenTinker run ended {task.state}: {task.error}; see {work}")
    finally:
        if client is not None:
            client.close()
        for name, proc in reversed(procs):
            demo.stop(proc, name)
    out = summarise("OpenTinker", rewards, ends)
    out["worker_step_s"] = worker_step_s
    return out


# --- TRL ----------------------------------------------------------------------------------------
def _pin(name: str) -> str:
    text = (ROOT / "constraints.txt").read_text()
    match = re.search(rf"^{re.escape(name)}==(\S+)", text, re.MULTILINE)
    if match is None:
        raise SystemExit(f"constraints.txt pins no {name}")
    return f"{name}=={match.group(1)}"


def ensure_peer_venv(venv: Path) -> Path:
    """The peer venv's interpreter, making the venv first when it has none."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"making the peer venv {venv} (torch, transformers, peft, trl {TRL_VERSION})", flush=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    for cmd in (
        ["python3", "-m", "venv", str(venv)],
        [*pip, _pin("torch")],
        [*pip, _pin("transformers"), _pin("peft"), f"trl=={TRL_VERSION}"],
    ):
        subprocess.run(cmd, check=True)
    return python


def run_trl(python: Path, model: Path, settings: dict, seed: int, work: Path) -> dict:
    """One ``GRPOTrainer`` run of ``scripts/peer_trl_grpo.py`` in its own session."""
    work.mkdir(parents=True)
    cfg = {**settings, "model": str(model), "seed": seed, "problems": problems(settings, seed)}
    cfg["output_dir"] = str(work / "trl")
    with open(work / "peer.log", "wb") as log:
        proc = subprocess.run(
            [str(python), str(PEER_SCRIPT), "--config", json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, **THREADS},
            start_new_session=True,
            check=False,
        )
    if proc.returncode != 0:
        raise SystemExit(f"TRL peer failed (exit {proc.returncode}); see {work / 'peer.log'}")
    report = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    steps = report["steps"]
    out = summarise(
        f"TRL {report['versions'].get('trl', '?')}", [s["reward"] for s in steps], [s["end_s"] for s in steps]
    )
    out["versions"] = report["versions"]
    out["peer"] = {k: report.get(k) for k in ("build_s", "gradient_checkpointing", "dtype")}
    return out


# --- the bench ----------------------------------------------------------------------------------
def pooled(runs: list[dict]) -> dict:
    """One side over its runs: the median of all step times after each run's first, the mean
    of the runs' first-3 and last-3 rewards."""
    intervals = [s for r in runs for s in r["step_s"]]
    return {
        "runs": len(runs),
        "s_per_step": statistics.median(intervals) if intervals else float("nan"),
        "reward_first3": statistics.fmean(r["reward_first3"] for r in runs),
        "reward_last3": statistics.fmean(r["reward_last3"] for r in runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=SETTINGS["steps"], help="optimizer steps per run (at least 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, in ABBA order")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first repeat; repeat r uses seed + r - 1")
    parser.add_argument("--only", choices=("opentinker", "trl"), help="run one side (no ratio)")
    parser.add_argument("--peer-venv", type=Path, default=ROOT / ".cache/peer-venv", help="made when missing")
    parser.add_argument("--peer-python", type=Path, help="the peer's interpreter (instead of --peer-venv)")
    parser.add_argument("--work-dir", type=Path, help="logs of every run (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the settings, runs and summary here")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step is warm-up, left out of s/step)")
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    model = args.model.resolve()
    if not (model / "config.json").exists():
        parser.error(f"--model: {model} is not a model folder (run `make install`)")
    settings = {**SETTINGS, "steps": args.steps}
    sides = [args.only] if args.only else ["opentinker", "trl"]
    python = None
    if "trl" in sides:
        python = args.peer_python or ensure_peer_venv(args.peer_venv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-grpo-trl-"))
    print(f"settings: {json.dumps(settings)}; OMP_NUM_THREADS=1 each side; logs in {work}", flush=True)

    demo.SIGNALS.install()
    runs: list[dict] = []
    for r in range(args.repeats):
        seed = args.seed + r
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            print(f"repeat {r + 1}, seed {seed}: {side}", flush=True)
            run_dir = work / f"r{r + 1}-{side}"
            if side == "opentinker":
                out = run_ours(model, settings, seed, run_dir)
            else:
                out = run_trl(python, model, settings, seed, run_dir)
            runs.append({**out, "key": side, "repeat": r + 1, "seed": seed})

    summary = {side: pooled([r for r in runs if r["key"] == side]) for side in sides}
    ratio = summary["trl"]["s_per_step"] / summary["opentinker"]["s_per_step"] if len(sides) == 2 else None
    print()
    print(f"{'side':<18} {'repeat':>6} {'seed':>4} {'s/step':>7} {'reward first 3':>15} {'last 3':>7}")
    for r in runs:
        print(
            f"{r['side']:<18} {r['repeat']:>6} {r['seed']:>4} {r['s_per_step']:>7.2f} "
            f"{r['reward_first3']:>15.3f} {r['reward_last3']:>7.3f}"
        )
    for side in sides:
        s = summary[side]
        name = next(r["side"] for r in runs if r["key"] == side)
        print(
            f"{name + ' (all)':<18} {s['runs']:>6} {'':>4} {s['s_per_step']:>7.2f} "
            f"{s['reward_first3']:>15.3f} {s['reward_last3']:>7.3f}"
        )
    if "opentinker" in summary:
        # The worker's own step time (perf/step_s): what the service path adds is the difference.
        inner = [s for r in runs if r["key"] == "opentinker" for s in r["worker_step_s"][1:]]
        summary["opentinker"]["worker_s_per_step"] = statistics.median(inner) if inner else float("nan")
        print(f"OpenTinker worker perf/step_s, median of steps 2..: {summary['opentinker']['worker_s_per_step']:.2f}")
    if ratio is not None:
        print(f"\nTRL s/step over OpenTinker s/step: {ratio:.2f}x (median over steps 2..{args.steps} of every run)")
    if args.json:
        record = {
            "settings": settings,
            "ours_fixed": OURS_FIXED,
            "model": str(model),
            "order": "ABBA",
            "threads": THREADS,
            "cpus": os.cpu_count(),
            "loadavg_end": os.getloadavg(),
            "runs": runs,
            "summary": summary,
            "ratio_trl_over_ours": ratio,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    if ratio is not None:
        ours, trl = summary["opentinker"], summary["trl"]
        write_result(
            "grpo-trl",
            what="LoRA GRPO on SmolLM2-135M-Instruct through the services: seconds per step at equal reward",
            peer=f"{next(r['side'] for r in runs if r['key'] == 'trl')} GRPOTrainer, same settings",
            ratios=[{"label": "s/step, TRL / ours (higher is better)", "value": round(ratio, 3)}],
            goal=">= 2.5x",
            settings={**settings, "steps": args.steps, "repeats": args.repeats, "order": "ABBA"},
            make="make bench-grpo-trl",
            notes=(
                f"Rewards, first 3 -> last 3 steps, mean of runs: ours {ours['reward_first3']:.3f} -> "
                f"{ours['reward_last3']:.3f}, TRL {trl['reward_first3']:.3f} -> {trl['reward_last3']:.3f}. "
                f"The peer ran with torch, transformers and peft at constraints.txt's pins and trl {TRL_VERSION} "
                f"(.cache/peer-venv, built when missing, or --peer-python). The worker's own step time "
                f"(perf/step_s) was {ours['worker_s_per_step']:.2f} s, the client-side {ours['s_per_step']:.2f} s: "
                "the difference is what the service path adds per step."
            ),
            details={
                "ours_s_per_step": round(ours["s_per_step"], 2),
                "trl_s_per_step": round(trl["s_per_step"], 2),
                "ours_reward_first3_last3": [round(ours["reward_first3"], 3), round(ours["reward_last3"], 3)],
                "trl_reward_first3_last3": [round(trl["reward_first3"], 3), round(trl["reward_last3"], 3)],
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
