"""LoRA GRPO on your own prompts with your own reward function, computed in this process.

The reward never leaves your machine: RLClient.serve_reward hosts it (EnvironmentService.Score,
an access token, TLS if you give a certificate), and the trainer calls it with batches of
(prompt, completion, metadata). See docs/rlvr.md.

    .venv/bin/python scripts/make_word_problems.py --out examples/word_problems.jsonl
    .venv/bin/python examples/client_reward.py --scheduler http://localhost:8888

On a cluster the trainers must reach this machine: serve_reward(..., host="0.0.0.0",
advertise_host="my-laptop.corp").
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from opentinker_client import RLClient

HERE = Path(__file__).resolve().parent


def reward(prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float]:
    """1.0 for the right number, a little credit for answering with a number at all.

    Anything goes here: an LLM judge, a test runner, a simulator. Return one number per item;
    NaN, None or a non-number leaves that item without a reward, raising fails the whole batch
    (after reward.max_consecutive_failures failed batches in a row the task ends FAILED).
    """
    out = []
    for completion, meta in zip(completions, metadata):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
        if not numbers:
            out.append(0.0)
        elif float(numbers[-1]) == float(meta["answer"]):
            out.append(1.0)
        else:
            out.append(0.1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheduler", default="http://localhost:8888")
    ap.add_argument("--dataset", type=Path, default=HERE / "word_problems.jsonl")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()

    with RLClient(scheduler_url=args.scheduler) as client:
        info = client.upload_dataset(args.dataset, format="prompts")
        print(f"uploaded {info.num_examples} prompts as {info.dataset_id}")
        with client.serve_reward(reward, timeout_s=30, max_consecutive_failures=3) as server:
            task_id = client.submit_task(
                workload_type="lora_finetune",
                env_config={
                    "env_id": "prompts",
                    "dataset_id": info.dataset_id,
                    "reward": server.reward_config,  # {"verifier": "client", "endpoint": ..., "token": ...}
                    "eval_fraction": 0.03,
                    "eval_every": 6,
                    "eval_threshold": 1.0,  # an eval reply counts as right at reward >= 1.0
                },
                hyperparameters={"steps": args.steps, "max_new_tokens": 12},
                gpu_count=0,
            )
            print(f"submitted {task_id}; reward served at {server.endpoint}")
            task = client.wait(task_id)
        print(f"{task_id}: {task.state}")
        for step, values in client.get_metric_history(task_id):
            if "eval/accuracy_start" in values:
                print(f"  before training: eval/accuracy {values['eval/accuracy_start']:.3f}")
            if "eval/accuracy" in values:
                print(f"  step {step}: eval/accuracy {values['eval/accuracy']:.3f}")


if __name__ == "__main__":
    main()
