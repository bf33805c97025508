#!/usr/bin/env python3
"""Learning check for RL on a prompt dataset with a verifiable reward (``env_id: prompts``).

Generates the grade-school word problems of ``scripts/make_word_problems.py`` (templates, two
or three steps, numeric answers, fixed seed; nothing downloaded), then runs ``lora_finetune``
(LoRA GRPO) on them in this process exactly as a trainer worker would (same code, same metrics),
twice on the same data and seed:

* ``numeric``: the built-in numeric verifier (last number / ``\\boxed{}`` / ``####``), plus a
  format term (0.5 when the reply is just a number) and a length term (0 up to 30 characters,
  -0.5 at 60: the lengths of a group's replies differ, so every group has a signal from the first
  step); shaping only: ``eval/accuracy`` counts the verifier alone;
* ``client``: the same score computed client-side — a Python function served from this process
  by a :class:`~opentinker_client.hosting.reward.RewardServer` (real gRPC on loopback, access
  token) and called by the trainer over ``EnvironmentService.Score``.

Prints the held-out greedy accuracy (``eval/accuracy``: the model's reply to each held-out
problem, the verifier's judgement) before the first update (``eval/accuracy_start``) and every
``--eval-every`` steps, the sampled reward per step, seconds per step, and a JSON line with
everything; accuracies with their binomial standard error. The evaluations score the same
held-out problems, so each is also compared *paired* with the starting model's
(:func:`paired_comparison`): how many problems went wrong -> right and right -> wrong, and the exact
McNemar test's two-sided p-value (:func:`mcnemar_exact`). Exits 0 when the held-out accuracy
after the last step is above the starting one in every run.

Two further comparisons: ``--baseline-system-prompt`` (on by default) also evaluates the starting
model under that prompt, same problems and token budget, and compares the numeric run's start and
end with it, paired (so a run under another system prompt, or from a warm start, is judged
against the plain model too); ``--warm-start-steps N`` first runs ``sft`` for ``N`` steps on
worked solutions to *other* generated problems (:func:`warm_start`) and starts GRPO from that
adapter, as a task with ``init_from`` would (docs/rlvr.md, "A warm start"). One torch thread
(``OMP_NUM_THREADS=1``): on a shared 2-core box two threads made the evaluation 3-4x slower.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_rlvr.py             # SmolLM2-135M-Instruct, both runs
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_rlvr.py --only numeric --length-weight 0   # format term only
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_rlvr.py --only numeric --steps 32 --lr 2e-3 --kl-coef 0.1
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_rlvr.py --only numeric --warm-start-steps 20 --lr 1e-4 \\
        --temperature 0.7 --max-new-tokens 32 --format-weight 0 --length-weight 0 \\
        --system-prompt 'Show each step as an equation.'                   # sft warm start, then GRPO
    .venv/bin/python scripts/bench_rlvr.py --model /path/to/tiny --steps 2 --eval-prompts 4   # smoke run
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_result import write_result  # noqa: E402  (imported at start: it notes the load then)

DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


#: A reply that is just a number: the format term's pattern (a small bonus, not counted as accuracy).
JUST_A_NUMBER = r"^\s*-?[0-9][0-9,]*(\.[0-9]+)?\s*\.?\s*$"

#: The shaping terms added to the numeric verifier, in the spec's form (``reward.terms``); set
#: from the arguments by :func:`shaping_terms` and used by both runs.
TERMS: list[dict] = []


def shaping_terms(args) -> list[dict]:
    """The format term (``--format-weight`` x "the reply is just a number") and the length term
    (``--length-weight`` x 0 up to ``--length-max-chars`` characters, falling to -1 at twice that)."""
    terms = []
    if args.format_weight:
        terms.append({"kind": "format", "weight": args.format_weight, "pattern": JUST_A_NUMBER})
    if args.length_weight:
        terms.append({"kind": "length", "weight": args.length_weight, "max_chars": args.length_max_chars})
    return terms


def client_reward(prompts, completions, metadata):
    """The client-side reward: the same numeric verifier and shaping terms, run in this process
    (as a user's own code would)."""
    from opentinker_common.verifiers import Term, make_reward

    terms = [Term(t["kind"], t["weight"], {k: v for k, v in t.items() if k not in ("kind", "weight")}) for t in TERMS]
    score = make_reward("numeric", {}, terms=terms)
    return [score(c, m["answer"]) for c, m in zip(completions, metadata)]


def std_err(p: float, n: int) -> float:
    """The binomial standard error of an accuracy ``p`` measured on ``n`` problems."""
    return math.sqrt(p * (1.0 - p) / n) if n else 0.0


def mcnemar_exact(gained: int, lost: int) -> float:
    """The exact McNemar test's two-sided p-value for paired right/wrong judgements.

    ``gained``: problems wrong before and right after; ``lost``: right before and wrong after (the
    problems judged alike both times carry no information). Under "no change" each of the
    ``n = gained + lost`` discordant problems is equally likely to go either way, so the smaller
    count is Binomial(n, 1/2); the p-value is twice its lower tail, at most 1 (1.0 when n = 0).
    The same as ``scipy.stats.binomtest(gained, n, 0.5).pvalue`` (McNemar 1947, Psychometrika 12;
    the exact form: Fagerland, Lydersen and Laake 2013, BMC Med Res Methodol 13:91).

    Raises:
        ValueError: a negative count.
    """
    if gained < 0 or lost < 0:
        raise ValueError(f"counts must be >= 0, got gained={gained}, lost={lost}")
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def paired_comparison(before: list[bool], after: list[bool]) -> dict:
    """Two evaluations of the same problems (``before[i]`` and ``after[i]``: problem ``i`` judged
    right) compared problem by problem: ``gained`` (wrong -> right), ``lost`` (right -> wrong) and
    the exact McNemar two-sided ``p`` (:func:`mcnemar_exact`).

    Raises:
        ValueError: the two lists are of different lengths (not the same problems).
    """
    if len(before) != len(after):
        raise ValueError(f"paired evaluations must score the same problems: {len(before)} vs {len(after)} judgements")
    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    return {"gained": gained, "lost": lost, "p": mcnemar_exact(gained, lost)}


class Progress(io.StringIO):
    """The worker's report stream, kept for the summary and echoed as one short line per step
    (a run takes minutes: show where it is)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def write(self, text: str) -> int:
        for line in text.splitlines():
            m = json.loads(line) if line.startswith("{") else {}
            if m.get("type") == "metric":
                v = m["values"]
                acc = "".join(
                    f" {k.removeprefix('eval/')} {v[k]:.3f}" for k in ("eval/accuracy_start", "eval/accuracy") if k in v
                )
                print(
                    f"  [{self.mode}] step {m['step']}: reward {v['reward']:.3f}, {v['perf/step_s']:.1f} s{acc}",
                    file=sys.stderr,
                    flush=True,
                )
        return super().write(text)


def task_parts(args, data: Path, reward: dict, system_prompt: str) -> tuple[dict, dict]:
    """The ``env_config`` and ``hyperparameters`` of the GRPO task (and of the baseline's
    evaluation): the same data, held-out split, token budget and seed in every run."""
    env = {
        "env_id": "prompts",
        "path": str(data),
        "reward": reward,
        "eval_fraction": args.eval_prompts / args.n,
        "max_eval_prompts": args.eval_prompts,
        "eval_every": args.eval_every,
        "seed": args.seed,
        "system_prompt": system_prompt or None,
    }
    hp = {
        "steps": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "learning_rate": args.lr,
        "kl_coef": args.kl_coef,
        "temperature": args.temperature,
        "seed": args.seed,
    }
    return env, hp


def worker_context(name: str, workload_type: str, args, env: dict, hp: dict, tmp: Path, out, init: Path | None = None):
    """The :class:`~opentinker_trainer.context.WorkerContext` a trainer worker would build for
    one attempt of task ``bench-rlvr-<name>`` on ``--model`` (CPU; checkpoints under
    ``tmp/<name>``; reports written to ``out``; starting from the ``peft_lora`` adapter ``init``
    when given, as an ``init_from`` task would)."""
    from opentinker_common.spec import TaskSpecModel
    from opentinker_trainer.context import WorkerContext

    spec = TaskSpecModel.from_parts(workload_type=workload_type, model=args.model, env_config=env, hyperparameters=hp)
    return WorkerContext(
        task_id=f"bench-rlvr-{name}",
        attempt=1,
        spec=spec,
        device="cpu",
        checkpoint_dir=tmp / name,
        out=out,
        init_checkpoint=init,
        init_format="peft_lora" if init else "",
    )


def baseline_judgements(args, data: Path, tmp: Path) -> list[bool]:
    """The starting model (``--model``, no adapter trained) on the same held-out problems, under
    ``--baseline-system-prompt`` and the same token budget: one greedy evaluation, the numeric
    verifier's judgement per problem (in the order every evaluation of :func:`run_one` uses)."""
    from opentinker_trainer.workloads import grpo_text

    env, hp = task_parts(args, data, {"verifier": "numeric"}, args.baseline_system_prompt)
    trainer = grpo_text._Trainer(worker_context("baseline", "lora_finetune", args, env, hp, tmp, io.StringIO()))
    trainer.evaluate(updates=0)
    return list(trainer.eval_right)


def warm_start(args, data: Path, tmp: Path) -> Path:
    """Supervised fine-tuning (``sft``, LoRA r=16, batch 8) for ``--warm-start-steps`` steps on
    worked solutions to ``--warm-start-examples`` *other* problems
    (:func:`make_word_problems.worked_examples`: none is in the RL file, so no held-out problem is
    trained on) answering ``--system-prompt``, in this process as a trainer worker runs it; returns the final
    adapter's folder (format ``peft_lora``), which GRPO then continues as an ``init_from``
    checkpoint would be. Deterministic, so the adapter is kept under ``--cache-dir`` by a hash of
    what made it (model, examples, hyper-parameters) and reused by later runs with the same settings."""
    import hashlib
    import shutil

    from make_word_problems import worked_examples
    from opentinker_trainer.workloads import sft

    rows = worked_examples(data, n=args.warm_start_examples, seed=args.seed, system_prompt=args.system_prompt)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    hp = {
        "steps": args.warm_start_steps,
        "batch_size": 8,
        "learning_rate": args.warm_start_lr,
        "lora_rank": 16,
        "seed": args.seed,
    }
    key = hashlib.sha256(json.dumps([str(Path(args.model).resolve()), text, hp]).encode()).hexdigest()[:16]
    cached = Path(args.cache_dir) / f"warm_start_{key}"
    if (cached / "adapter_config.json").exists():
        print(f"  [warm start] reusing {cached}", file=sys.stderr, flush=True)
        return cached
    path = tmp / "warm_start.jsonl"
    path.write_text(text)
    env = {"env_id": "chat_jsonl", "path": str(path), "eval_fraction": 0.05, "seed": args.seed}
    ctx = worker_context("warm_start", "sft", args, env, hp, tmp, io.StringIO())
    t0 = time.perf_counter()
    sft.run(ctx)
    final = tmp / "warm_start" / f"step_{args.warm_start_steps}"
    reports = [json.loads(line) for line in ctx.out.getvalue().splitlines() if line.startswith("{")]
    losses = [m["values"]["loss/eval"] for m in reports if m.get("type") == "metric" and "loss/eval" in m["values"]]
    print(
        f"  [warm start] {args.warm_start_steps} sft steps on {len(rows)} worked solutions, "
        f"{time.perf_counter() - t0:.0f} s; held-out loss {losses[-1] if losses else float('nan'):.3f}",
        file=sys.stderr,
        flush=True,
    )
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(final, cached.with_suffix(".tmp"), dirs_exist_ok=True)
    cached.with_suffix(".tmp").rename(cached)
    return cached


def run_one(mode: str, args, data: Path, tmp: Path, init: Path | None = None) -> dict:
    from opentinker_client.hosting.reward import RewardServer
    from opentinker_trainer.workloads import grpo_text

    # Each evaluation's per-problem judgements (the trainer keeps them on ``eval_right``), by the
    # number of updates before it: the paired comparison needs them, the metrics carry only means.
    judged: dict[int, list[bool]] = {}
    original = grpo_text._Trainer.evaluate

    def evaluate(trainer, updates: int) -> dict:
        out = original(trainer, updates)
        judged[updates] = list(trainer.eval_right)
        if updates and 0 in judged:
            c = paired_comparison(judged[0], judged[updates])
            print(
                f"  [{mode}] eval after {updates} steps vs step 0: +{c['gained']} -{c['lost']} "
                f"(McNemar p {c['p']:.3g})",
                file=sys.stderr,
                flush=True,
            )
        return out

    grpo_text._Trainer.evaluate = evaluate
    server = RewardServer(client_reward).start() if mode == "client" else None
    try:
        reward = server.reward_config if server else {"verifier": "numeric", "terms": TERMS}
        env, hp = task_parts(args, data, reward, args.system_prompt)
        ctx = worker_context(mode, "lora_finetune", args, env, hp, tmp, Progress(mode), init)
        t0 = time.perf_counter()
        grpo_text.run(ctx)
        wall = time.perf_counter() - t0
    finally:
        grpo_text._Trainer.evaluate = original
        if server is not None:
            server.stop(grace=0)
    metrics = [json.loads(line) for line in ctx.out.getvalue().splitlines()]
    metrics = [m for m in metrics if m["type"] == "metric"]
    first = metrics[0]["values"]
    n_eval = int(metrics[-1]["values"]["eval/prompts"])
    curve = [(0, first["eval/accuracy_start"])] + [
        (m["step"], m["values"]["eval/accuracy"]) for m in metrics if "eval/accuracy" in m["values"]
    ]
    paired = [
        {"step": s, "right": sum(judged[s]), **paired_comparison(judged[0], judged[s])} for s in sorted(judged) if s
    ]
    rewards = [round(m["values"]["reward"], 3) for m in metrics]
    steps_s = [m["values"]["perf/step_s"] for m in metrics]
    return {
        "mode": mode,
        # (step, held-out greedy accuracy, its binomial standard error)
        "accuracy_curve": [(s, round(a, 4), round(std_err(a, n_eval), 4)) for s, a in curve],
        "accuracy_before": curve[0][1],
        "accuracy_after": curve[-1][1],
        # each evaluation against step 0, problem by problem: wrong->right, right->wrong, McNemar p
        "paired_vs_start": paired,
        "reward_per_step": rewards,
        "eval_prompts": n_eval,
        "step_s": sum(steps_s) / len(steps_s),
        "wall_s": wall,
        "client_missing": sum(m["values"].get("reward/client_missing", 0.0) for m in metrics),
        # the last evaluation's per-problem judgements (for the baseline comparison; not reported)
        "final_right": judged[max(judged)],
        "start_right": judged[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--only", choices=("numeric", "client"), action="append", help="run only this (repeatable)")
    ap.add_argument("-n", type=int, default=3000, help="word problems generated")
    ap.add_argument("--eval-prompts", type=int, default=160, help="held-out problems scored per evaluation")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the base model (adapter off); 0: none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format-weight", type=float, default=0.5, help='weight of "the reply is just a number"')
    ap.add_argument("--length-weight", type=float, default=0.5, help="weight of the length term (0: none)")
    ap.add_argument("--length-max-chars", type=int, default=30, help="the length term is 0 up to this many characters")
    ap.add_argument("--system-prompt", default="Reply with only the final number.")
    ap.add_argument(
        "--baseline-system-prompt",
        default="Reply with only the final number.",
        help="also evaluate the starting model under this system prompt and compare the numeric run's last "
        "evaluation with it, paired; '' skips it",
    )
    ap.add_argument(
        "--warm-start-steps", type=int, default=0, help="sft steps on worked solutions before GRPO (0: none)"
    )
    ap.add_argument("--warm-start-examples", type=int, default=1000, help="worked solutions the warm start trains on")
    ap.add_argument("--warm-start-lr", type=float, default=1e-3, help="the warm start's LoRA learning rate")
    ap.add_argument(
        "--cache-dir", default=str(ROOT / ".cache" / "bench_rlvr"), help="where warm-start adapters are kept for reuse"
    )
    args = ap.parse_args()

    from make_word_problems import write

    TERMS[:] = shaping_terms(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_rlvr_") as tmp:
        data = write(Path(tmp) / "word_problems.jsonl", n=args.n, seed=args.seed)
        baseline = None
        if args.baseline_system_prompt and "numeric" in (args.only or ("numeric",)):
            baseline = baseline_judgements(args, data, Path(tmp))
            print(
                f"baseline  the starting model under {args.baseline_system_prompt!r}: held-out accuracy "
                f"{sum(baseline) / len(baseline):.3f} ({sum(baseline)}/{len(baseline)})",
                flush=True,
            )
        init = warm_start(args, data, Path(tmp)) if args.warm_start_steps else None
        for mode in args.only or ("numeric", "client"):
            r = run_one(mode, args, data, Path(tmp), init)
            final_right, start_right = r.pop("final_right"), r.pop("start_right")
            if baseline is not None and mode == "numeric":
                r["baseline"] = {"right": sum(baseline), "of": len(baseline)}
                r["vs_baseline_prompt"] = {
                    "start": paired_comparison(baseline, start_right),
                    "final": paired_comparison(baseline, final_right),
                }
            results.append(r)
            n_eval = r["eval_prompts"]
            curve = ", ".join(f"{s}: {a:.3f} ± {e:.3f}" for s, a, e in r["accuracy_curve"])
            print(
                f"{mode:8s} held-out accuracy ({n_eval} problems, greedy; ± binomial std err): "
                f"{r['accuracy_before']:.3f} ± {std_err(r['accuracy_before'], n_eval):.3f} before -> "
                f"{r['accuracy_after']:.3f} ± {std_err(r['accuracy_after'], n_eval):.3f} after {args.steps} steps; "
                f"by step {curve}",
                flush=True,
            )
            pairs = ", ".join(f"{c['step']}: +{c['gained']} -{c['lost']} p {c['p']:.3g}" for c in r["paired_vs_start"])
            print(f"         paired vs step 0 (wrong->right, right->wrong, exact McNemar p): {pairs}", flush=True)
            if "vs_baseline_prompt" in r:
                for when, c in r["vs_baseline_prompt"].items():
                    print(
                        f"         {when} vs the starting model under the baseline prompt: +{c['gained']} -{c['lost']} "
                        f"p {c['p']:.3g}",
                        flush=True,
                    )
            print(f"         sampled reward per step {r['reward_per_step']}", flush=True)
            print(f"         {r['step_s']:.1f} s/step, {r['wall_s']:.0f} s in all (incl. loading and evaluation)")
    print(
        f"lora_finetune on {Path(args.model).name}, {args.steps} steps x {args.prompts_per_step} prompts x "
        f"{args.group_size} samples, {args.max_new_tokens} new tokens, lr {args.lr:g}, kl_coef {args.kl_coef:g}, "
        f"seed {args.seed}"
    )
    write_result(
        "rlvr-word-problems",
        what="Held-out greedy accuracy on word problems after LoRA GRPO with a numeric verifier",
        peer="the same model before training, on the same problems",
        ratios=[
            {
                "label": f"{r.get('mode', 'reward')} reward: accuracy after / before (paired McNemar p "
                f"{r['paired_vs_start'][-1]['p']:.2g})"
                if r["paired_vs_start"]
                else "accuracy after / before",
                "value": round(r["accuracy_after"] / r["accuracy_before"], 3) if r["accuracy_before"] else None,
            }
            for r in results
        ],
        goal="rises, paired test",
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        make="make bench-rlvr",
        details={"accuracy_before_after": [[r["accuracy_before"], r["accuracy_after"]] for r in results]},
    )
    print(json.dumps({"args": vars(args), "results": results}))
    return 0 if all(r["accuracy_after"] > r["accuracy_before"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
