"""Arithmetic GRPO written entirely client-side on training primitives (docs/primitives.md).

The cluster holds the model and its LoRA adapter; this file is the whole algorithm: sample a
group of replies per problem, score them, turn group-relative rewards into advantages
(DeepSeekMath's GRPO, https://arxiv.org/abs/2402.03300), and take a policy-gradient step with
``importance_sampling`` (ratio to the sampler's logprobs, a token mean via the advantages).

With ``make scheduler`` and ``make trainer`` running (the session trains the scheduler's
``default_model`` unless ``--model`` names another folder under ``paths.model_dirs``)::

    .venv/bin/python examples/own_loop_rl.py --steps 20
    .venv/bin/python examples/own_loop_rl.py --steps 2 --problems 2 --group-size 4   # a quick try on CPU
"""

from __future__ import annotations

import argparse
import random
import statistics

from opentinker_client import Datum, RLClient
from opentinker_common.arithmetic import DEFAULT_INSTRUCTION, Problem, reward


def group_advantages(rewards: list[float]) -> list[float]:
    """``(r - mean) / (std + 1e-6)`` within one group; all 0 when the rewards are all equal."""
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def train(
    session, *, steps: int, problems_per_step=8, group_size=8, max_tokens=12, learning_rate=5e-4, seed=0, log=print
):
    """Run ``steps`` GRPO steps on ``session``; returns the mean reward of each step."""
    rng = random.Random(seed)
    history = []
    for step in range(1, steps + 1):
        problems = [
            Problem(a, b, DEFAULT_INSTRUCTION.format(a=a, b=b))
            for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(problems_per_step))
        ]
        samples = [  # queued at once; the session decodes them in one batch
            session.sample(
                messages=[{"role": "user", "content": p.question}],
                n=group_size,
                max_tokens=max_tokens,
                temperature=1.0,
                seed=rng.randrange(2**31),
            )
            for p in problems
        ]
        rewards, rollouts = [], []
        for problem, future in zip(problems, samples):
            out = future.result()
            group = [reward(s.text, problem) for s in out.samples]
            rewards += group
            for s, adv in zip(out.samples, group_advantages(group)):
                if adv and s.tokens:
                    rollouts.append((out.prompt_tokens, s, adv))
        tokens = sum(len(s.tokens) for _, s, _ in rollouts) or 1  # a token mean over the batch
        batch = [
            Datum.from_sequence(
                prompt + s.tokens,
                prompt_length=len(prompt),
                advantage=adv / tokens,
                sampling_logprobs=s.sampling_logprobs,
            )
            for prompt, s, adv in rollouts
        ]
        loss = 0.0
        if batch:
            fb = session.forward_backward(batch, "importance_sampling")
            opt = session.optim_step(learning_rate=learning_rate)  # queued behind forward_backward
            loss, _ = fb.result().loss, opt.result()
        history.append(statistics.fmean(rewards))
        log(f"step {step}: reward {history[-1]:.3f} loss {loss:+.4f} datums {len(batch)}")
    return history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheduler", default="http://localhost:8888")
    p.add_argument("--model", default="", help="a model folder on the trainers; default: the scheduler's default_model")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--problems", type=int, default=8, help="problems per step")
    p.add_argument("--group-size", type=int, default=8, help="replies sampled per problem")
    p.add_argument("--lr", type=float, default=5e-4)
    args = p.parse_args()
    with RLClient(scheduler_url=args.scheduler) as client:
        session = client.create_training_session(args.model, lora_rank=16, lora_alpha=32, idle_timeout=600)
        history = train(
            session,
            steps=args.steps,
            problems_per_step=args.problems,
            group_size=args.group_size,
            learning_rate=args.lr,
        )
        print(f"first-3 reward {statistics.fmean(history[:3]):.3f}, last-3 {statistics.fmean(history[-3:]):.3f}")
        client.cancel(session.task_id)


if __name__ == "__main__":
    main()
