#!/usr/bin/env python3
"""Learning check for ``sft``: does supervised fine-tuning on a small arithmetic chat dataset
lower the held-out loss of a real model within a few minutes?

Writes a JSONL dataset of ``"What is a + b? Answer with just the number."`` -> ``"<a + b>"``
conversations (the built-in ``arithmetic`` environment's prompt, so the result is also the warm
start an RL task would use with ``init_from``), runs the ``sft`` workload in this process exactly
as a trainer worker would (same code, same metrics), and prints:

* ``loss/eval`` on the held-out split before training and after the last step, and their ratio;
* greedy accuracy on up to 64 held-out questions before and after (the reply's last integer must
  be the sum, as the environment's reward counts it);
* seconds per step and tokens per second (measured in this run; no fixed thresholds).

Usage::

    .venv/bin/python scripts/bench_sft.py                       # LoRA r=16 on SmolLM2-135M-Instruct
    .venv/bin/python scripts/bench_sft.py --full --lr 2e-5      # all weights
    .venv/bin/python scripts/bench_sft.py --model /path/to/tiny --steps 3   # smoke run
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
QUESTION = "What is {a} + {b}? Answer with just the number."


def write_dataset(path: Path, n: int, seed: int, max_digits: int) -> None:
    rng = random.Random(seed)
    hi = 10**max_digits - 1
    with open(path, "w") as fh:
        for _ in range(n):
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            msgs = [
                {"role": "user", "content": QUESTION.format(a=a, b=b)},
                {"role": "assistant", "content": str(a + b)},
            ]
            fh.write(json.dumps({"messages": msgs}) + "\n")


def greedy_accuracy(model, tokenizer, conversations: list[list[dict]], device) -> float:
    """Fraction of questions whose greedy reply's last integer is the reference answer."""
    import torch

    from opentinker_common.arithmetic import last_number

    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True) for c in conversations]
    right = 0
    model.eval()
    for i in range(0, len(prompts), 16):
        enc = tokenizer(prompts[i : i + 16], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for reply, conv in zip(replies, conversations[i : i + 16]):
            got = last_number(reply)
            right += int(got is not None and got == int(conv[-1]["content"]))
    return right / len(conversations)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--examples", type=int, default=320)
    ap.add_argument("--eval-fraction", type=float, default=0.2)
    ap.add_argument("--max-digits", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="default 2e-4 (LoRA) or 2e-5 (--full)")
    ap.add_argument("--full", action="store_true", help="train all weights instead of a LoRA adapter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-accuracy", action="store_true", help="skip the greedy accuracy check")
    args = ap.parse_args()

    import torch

    from opentinker_common.spec import TaskSpecModel
    from opentinker_trainer.context import WorkerContext
    from opentinker_trainer.workloads import _lm, sft
    from opentinker_trainer.workloads.sft_data import read_chat_jsonl, split_indices

    torch.set_num_threads(max(1, torch.get_num_threads()))
    lr = args.lr if args.lr is not None else (2e-5 if args.full else 2e-4)
    with tempfile.TemporaryDirectory(prefix="bench_sft_") as tmp:
        data = Path(tmp) / "arith.jsonl"
        write_dataset(data, args.examples, args.seed, args.max_digits)
        env = {"env_id": "chat_jsonl", "path": str(data), "eval_fraction": args.eval_fraction, "seed": args.seed}
        hp = {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "learning_rate": lr,
            "lora": not args.full,
            "seed": args.seed,
            "eval_every": max(1, args.steps // 3),
        }
        spec = TaskSpecModel.from_parts(workload_type="sft", model=args.model, env_config=env, hyperparameters=hp)
        ctx = WorkerContext(
            task_id="bench-sft", attempt=1, spec=spec, device="cpu", checkpoint_dir=Path(tmp) / "ck", out=io.StringIO()
        )

        examples = read_chat_jsonl(data)
        _, held = split_indices(len(examples), args.eval_fraction, args.seed)
        questions = [examples[i] for i in held[:64]]
        acc_before = acc_after = None
        if not args.no_accuracy:
            tok, base = _lm.load_model(args.model, torch.device("cpu"), torch.float32)
            acc_before = greedy_accuracy(base, tok, questions, "cpu")
            del base

        t0 = time.perf_counter()
        sft.run(ctx)
        wall = time.perf_counter() - t0
        reports = [json.loads(line) for line in ctx.out.getvalue().splitlines()]
        metrics = [r for r in reports if r["type"] == "metric"]
        final = [r for r in reports if r["type"] == "checkpoint"][-1]
        start = metrics[0]["values"]["loss/eval_start"]
        end = metrics[-1]["values"]["loss/eval"]
        curve = [(m["step"], round(m["values"]["loss/eval"], 4)) for m in metrics if "loss/eval" in m["values"]]
        step_s = sum(m["values"]["perf/step_s"] for m in metrics) / len(metrics)
        tok_s = sum(m["values"]["perf/tokens_per_s"] for m in metrics) / len(metrics)

        if not args.no_accuracy:
            tok, model = _lm.load_model(
                args.model if not args.full else final["path"], torch.device("cpu"), torch.float32
            )
            if not args.full:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, final["path"])
            acc_after = greedy_accuracy(model, tok, questions, "cpu")

    mode = "full weights" if args.full else "LoRA r=16 (q,k,v,o)"
    print(
        f"sft on {Path(args.model).name}, {mode}, lr {lr:g}, {args.steps} "
        f"steps x {args.batch_size} examples, {len(held)} held out"
    )
    print(f"  loss/eval: {start:.4f} before -> {end:.4f} after ({end / start:.3f} of the start); curve {curve}")
    if acc_before is not None:
        print(
            f"  greedy accuracy on {len(questions)} held-out questions: "
            f"{acc_before:.3f} before -> {acc_after:.3f} after"
        )
    print(f"  {step_s:.2f} s/step, {tok_s:.0f} tokens/s, {wall:.0f} s in all (incl. loading and evaluation)")
    print(
        json.dumps(
            {
                "eval_loss_start": start,
                "eval_loss_end": end,
                "ratio": end / start,
                "acc_before": acc_before,
                "acc_after": acc_after,
                "step_s": step_s,
                "wall_s": wall,
            }
        )
    )
    return 0 if end < start else 1


if __name__ == "__main__":
    sys.exit(main())
