#!/usr/bin/env python3
"""Throughput of a distributed task at world size 1 and 2 on this machine's CPUs (gloo ranks).

Runs the real worker (``python -m opentinker_trainer.worker``) on an ``AssignTask`` with 1 and
then 2 simulated devices, as a ``--simulate-gpus`` node does, for

* ``grpo``: ``lora_finetune`` GRPO on a small random Llama (SmolLM2's tokenizer, hidden 256,
  4 layers; LoRA r 8), 8 groups x 4 samples, 16 new tokens;
* ``grpo-full``: the same GRPO on all weights (``full_rl``; at world size 2 the weights are
  sharded with FSDP2 and sampling is synced across ranks);
* ``ppo``: ``full_rl`` PPO on CartPole-v1, 8 envs x 128 steps per update;

and prints, per world size, the median over steps (the first, warm-up, left out) of the step
time, completion tokens or env steps per second of the global batch (the workers' own
``perf/*`` metrics), the wall time of the run (start-up of the ranks included), and the load
average before and after (other processes share the machine). Each rank runs one torch thread.

    .venv/bin/python scripts/bench_distributed.py [--only grpo|grpo-full|ppo] [--steps N]

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "scripts")]

from tests.support.distributed import run_worker, task_spec  # noqa: E402

from bench_result import write_result  # noqa: E402  (imported at start: it notes the load then)

MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def small_llama(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def bench(tmp: Path, name: str, spec, rate_key: str, world: int) -> dict:
    before = load()
    t0 = time.perf_counter()
    run = run_worker(tmp, f"{name}-{world}", spec, devices=world, timeout_s=3600)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise SystemExit(f"{name} world {world} failed:\n{run.stderr[-3000:]}")
    steps = [m["values"] for m in run.of("metric")][1:]
    return {
        "step_s": statistics.median(v["perf/step_s"] for v in steps),
        "rate": statistics.median(v[rate_key] for v in steps),
        "wall_s": wall,
        "load": f"{before} -> {load()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("grpo", "grpo-full", "ppo"), action="append")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    only = args.only or ["grpo", "ppo"]
    print(f"machine: {os.cpu_count()} CPUs; ranks use gloo, 1 torch thread each")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cases = []
        model = small_llama(tmp / "small-llama") if {"grpo", "grpo-full"} & set(only) else None
        if "grpo" in only:
            hp = {
                "steps": args.steps,
                "prompts_per_step": 8,
                "group_size": 4,
                "max_new_tokens": 16,
                "lora_rank": 8,
                "checkpoint_every": 0,
            }
            spec = task_spec(
                workload_type="lora_finetune", model=model, env_config={"env_id": "arithmetic"}, hyperparameters=hp
            )
            cases.append(("grpo", spec, "perf/tokens_per_s", "completion tokens/s"))
        if "grpo-full" in only:
            hp = {
                "steps": args.steps,
                "prompts_per_step": 8,
                "group_size": 4,
                "max_new_tokens": 16,
                "learning_rate": 1e-5,
                "checkpoint_every": 0,
            }
            spec = task_spec(
                workload_type="full_rl", model=model, env_config={"env_id": "arithmetic"}, hyperparameters=hp
            )
            cases.append(("grpo-full", spec, "perf/tokens_per_s", "completion tokens/s"))
        if "ppo" in only:
            hp = {"total_timesteps": 1024 * args.steps, "num_envs": 8, "num_steps": 128, "checkpoint_every": 0}
            spec = task_spec(
                workload_type="full_rl", model="mlp", env_config={"env_id": "CartPole-v1"}, hyperparameters=hp
            )
            cases.append(("ppo", spec, "perf/env_steps_per_s", "env steps/s"))
        speedups = []
        for name, spec, key, unit in cases:
            print(f"\n{name}: median of steps 2..{args.steps}")
            print(
                f"{'world':>5} {'step s':>8} {unit:>20} {'speed-up':>9} {'run wall s':>11}  load avg (before -> after)"
            )
            base = None
            for world in (1, 2):
                r = bench(tmp, name, spec, key, world)
                base = base or r["rate"]
                print(
                    f"{world:>5} {r['step_s']:>8.3f} {r['rate']:>20.1f} {r['rate'] / base:>8.2f}x "
                    f"{r['wall_s']:>11.1f}  {r['load']}"
                )
            speedups.append({"label": f"{name} {unit}, world size 2 / 1", "value": round(r["rate"] / base, 3)})
        write_result(
            "distributed-world-size",
            what="Distributed tasks: throughput at world size 2 (gloo ranks on the CPUs)",
            peer="world size 1, same run",
            ratios=speedups,
            settings={"steps": args.steps, "cases": [c[0] for c in cases]},
            make="make bench-distributed",
        )


if __name__ == "__main__":
    main()
