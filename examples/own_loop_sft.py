"""Supervised fine-tuning written client-side: ``cross_entropy`` on the reply tokens only.

Tokenizes chat examples here (the session's tokenizer, loaded with transformers from the model's
files; no torch needed), weighs each reply token ``1 / (reply tokens in the batch)`` so the loss is
the token-mean NLL of the built-in ``sft`` step, then ``forward_backward`` + ``optim_step``.

With ``make scheduler`` and ``make trainer`` running (the session trains the scheduler's
``default_model`` unless ``--model`` names another folder under ``paths.model_dirs``; run it from
the folder the scheduler runs in, so the model's tokenizer files are found here too)::

    .venv/bin/python examples/own_loop_sft.py --steps 10
"""

from __future__ import annotations

import argparse
import random

from opentinker_client import Datum, RLClient


def chat_datums(tokenizer, examples: list[tuple[str, str]]) -> list[Datum]:
    """One datum per (question, answer): trained on the answer's tokens (and its end of turn)."""
    encoded = []
    for question, answer in examples:
        user = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=True)
        prompt, full = list(getattr(prompt, "input_ids", prompt)), list(getattr(full, "input_ids", full))
        encoded.append((full, len(prompt)))
    tokens = sum(len(full) - n for full, n in encoded)
    return [Datum.from_sequence(full, prompt_length=n, weight=1.0 / tokens) for full, n in encoded]


def train(session, tokenizer, *, steps: int, batch_size=8, learning_rate=1e-3, seed=0, log=print) -> list[float]:
    """``steps`` SFT steps on one-digit additions; returns each step's mean NLL per reply token."""
    rng = random.Random(seed)
    losses = []
    for step in range(1, steps + 1):
        pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(batch_size)]
        batch = chat_datums(tokenizer, [(f"What is {a} + {b}?", str(a + b)) for a, b in pairs])
        fb = session.forward_backward(batch, "cross_entropy")
        opt = session.optim_step(learning_rate=learning_rate)
        losses.append(fb.result().loss)
        log(f"step {step}: loss {losses[-1]:.4f} (optimizer step {opt.result().step})")
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheduler", default="http://localhost:8888")
    p.add_argument("--model", default="", help="a model folder on the trainers; default: the scheduler's default_model")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="examples per step")
    args = p.parse_args()
    with RLClient(scheduler_url=args.scheduler) as client:
        session = client.create_training_session(args.model, lora_rank=16, idle_timeout=600)
        train(session, session.get_tokenizer(), steps=args.steps, batch_size=args.batch_size)
        client.cancel(session.task_id)


if __name__ == "__main__":
    main()
