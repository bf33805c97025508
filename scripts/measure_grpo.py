#!/usr/bin/env python3
"""Measure ``lora_finetune`` on the real SmolLM2-135M-Instruct, in-process, on this machine.

Runs the workload with the GRPOConfig defaults (override any with ``--set key=value``) on the
``arithmetic`` task and prints per-step reward, loss and seconds, then the mean reward of the
first 3 and the last 3 steps. Checkpoints go to a temporary folder (or ``--checkpoint-dir``).

    .venv/bin/python scripts/measure_grpo.py --seed 1
    .venv/bin/python scripts/measure_grpo.py --seed 2 --set steps=20 --set learning_rate=1e-3
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from opentinker_common.spec import TaskSpecModel  # noqa: E402
from opentinker_trainer.context import WorkerContext  # noqa: E402


class _Tee(io.TextIOBase):
    """Collects the JSON report lines and prints each step as it arrives."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def write(self, s: str) -> int:
        for line in s.splitlines():
            if line.strip():
                rec = json.loads(line)
                self.lines.append(rec)
                if rec["type"] == "metric":
                    v = rec["values"]
                    print(
                        f"step {rec['step']:3d}  reward {v['reward']:.3f}  loss {v['loss']:+.4f}  "
                        f"kl {v.get('kl', math.nan):.4f}  zero_std {v['zero_std_frac']:.2f}  "
                        f"step_s {v['perf/step_s']:.1f} (generate {v['perf/generate_s']:.1f})",
                        flush=True,
                    )
        return len(s)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / ".cache/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--seed", type=int, default=None, help="hyperparameters.seed (default: GRPOConfig's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a hyper-parameter")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write all report lines here")
    args = parser.parse_args()

    hp = {}
    for item in args.set:
        key, _, value = item.partition("=")
        hp[key] = _value(value)
    if args.seed is not None:
        hp["seed"] = args.seed
    spec = TaskSpecModel.from_parts(
        workload_type="lora_finetune", model=args.model, env_config={"env_id": "arithmetic"}, hyperparameters=hp
    )
    print("hyperparameters:", json.dumps(spec.to_dict()["hyperparameters"]), flush=True)

    from opentinker_trainer.workloads import grpo_text

    out = _Tee()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = WorkerContext(
            task_id="measure", attempt=1, spec=spec, device=args.device,
            checkpoint_dir=args.checkpoint_dir or Path(tmp), out=out,
        )  # fmt: skip
        started = time.perf_counter()
        grpo_text.run(ctx)
        total = time.perf_counter() - started
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in out.lines))

    rewards = [r["values"]["reward"] for r in out.lines if r["type"] == "metric"]
    step_s = [r["values"]["perf/step_s"] for r in out.lines if r["type"] == "metric"]
    first, last = rewards[:3], rewards[-3:]
    print(f"total {total:.1f} s (load + {len(rewards)} steps; mean step {sum(step_s) / len(step_s):.1f} s)")
    print(f"reward first 3 steps: {sum(first) / len(first):.3f}   last 3 steps: {sum(last) / len(last):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
