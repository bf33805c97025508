#!/usr/bin/env python3
"""The Tinker API's cost, on a real scheduler, trainer and gateway on loopback, in one run.

1. **SL step**: a cookbook-shaped supervised step (``forward_backward`` with ``cross_entropy`` on
   ``--batch`` chat conversations of the cookbook's example_data, then ``optim_step``) through the
   unmodified ``tinker`` SDK and the gateway, against the same datums sent to a session directly
   with ``opentinker_client`` (``RLClient.create_training_session``), same LoRA rank, target
   modules (Tinker's default: attention, MLP and ``lm_head``) and Adam settings. Seconds per
   step, median of ``--steps`` after one warm-up step each. Each side's client is a process in
   its own session, with its own session task on the same trainer; their steps alternate.
   Goal: API / direct <= 1.1.
2. **math_rl sampling**: the sampling of one ``math_rl``-shaped step (``--groups`` x ``--group-size``
   rollouts of arithmetic prompts, ``num_samples=1`` each, ``--max-tokens`` new tokens) from a
   sampler save: every rollout's ``sample`` at once, as the cookbook sends them (the gateway
   batches them), against one call per rollout, each awaited before the next. Median of
   ``--rounds``. Goal: batched / one per rollout <= 0.5.

Prints the figures; writes ``tinker.json`` under ``$BENCH_RESULTS_DIR`` (``make bench-tinker``).
Usage: .venv/bin/python scripts/bench_tinker.py [--model DIR] [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)

DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
CONFIG = "heartbeat_interval: 0.5\nlease: 3\nworkload_types:\n  - type: lora_session\n    priority: 3\n"
#: Tinker's AdamParams defaults, used on both sides of the SL comparison.
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}


def conversations(tokenizer, n: int, max_length: int) -> list[list[int]]:
    """The first ``n`` conversations of the cookbook's example data, tokenized with the chat template."""
    import tinker_cookbook

    path = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()[:n]]
    return [chat_tokens(tokenizer, m)[:max_length] for m in rows]


def chat_tokens(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def sl_side(args) -> None:
    """One side of the SL comparison, in a process of its own (``--side api|direct``): set up a
    session, take a warm-up step, print ``ready``; then one step per ``step`` line on stdin, its
    seconds printed; end the session at EOF."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sequences = conversations(tokenizer, args.batch, args.max_length)
    if args.side == "api":
        import tinker
        from tinker import types

        service = tinker.ServiceClient()
        training = service.create_lora_training_client(base_model=args.model_name, rank=args.rank).result()
        datums = [
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
            )
            for s in sequences
        ]

        def step() -> float:
            start = time.perf_counter()
            fb = training.forward_backward(datums, "cross_entropy")
            optim = training.optim_step(types.AdamParams(**ADAM))
            fb.result()
            optim.result()
            return time.perf_counter() - start

        def close() -> None:
            service.close("success").result()

    else:
        from opentinker_client import RLClient
        from opentinker_client.training import Datum

        client = RLClient(scheduler_url=args.scheduler_url)
        from opentinker_common.lora_memory import read_model_config
        from opentinker_common.lora_targets import tinker_target_modules

        # The adapter the API side gets: Tinker's default LoraConfig (attention, MLP and lm_head).
        targets = tinker_target_modules(
            train_mlp=True, train_attn=True, train_unembed=True, model_config=read_model_config(args.model) or {}
        )
        session = client.create_training_session(
            args.model, lora_rank=args.rank, target_modules=list(targets), name="bench-tinker direct"
        )
        datums = [Datum(input_tokens=s[:-1], target_tokens=s[1:], weights=[1.0] * (len(s) - 1)) for s in sequences]

        def step() -> float:
            start = time.perf_counter()
            fb = session.forward_backward(datums, "cross_entropy")
            optim = session.optim_step(
                ADAM["learning_rate"], beta1=ADAM["beta1"], beta2=ADAM["beta2"], eps=ADAM["eps"], max_grad_norm=0.0
            )
            fb.result()
            optim.result()
            return time.perf_counter() - start

        def close() -> None:
            client.cancel(session.task_id)

    try:
        step()  # warm-up
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "step":
                print(f"{step():.6f}", flush=True)
    finally:
        close()


def sl_steps(args, scheduler_url: str, env: dict) -> tuple[list[float], list[float]]:
    """Seconds of each timed SL step through the API and directly. Each side is a process in its
    own session (this kernel shares CPU per session) with its own session task; steps alternate
    between the sides (ABAB) after one warm-up step each."""
    import subprocess

    sides = {}
    for side in ("api", "direct"):
        argv = [sys.executable, __file__, "--side", side, "--scheduler-url", scheduler_url, "--model", args.model]
        argv += ["--model-name", args.model_name, "--rank", str(args.rank), "--batch", str(args.batch)]
        argv += ["--max-length", str(args.max_length)]
        sides[side] = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
    try:
        for side, proc in sides.items():
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"the {side} side did not start (exit {proc.poll()}): {line!r}")
        out: dict[str, list[float]] = {"api": [], "direct": []}
        for i in range(args.steps):
            for side in ("api", "direct") if i % 2 == 0 else ("direct", "api"):
                proc = sides[side]
                proc.stdin.write("step\n")
                proc.stdin.flush()
                out[side].append(float(proc.stdout.readline()))
    finally:
        for proc in sides.values():
            proc.stdin.close()
        for proc in sides.values():
            proc.wait(timeout=120)
    return out["api"], out["direct"]


def sampling(service, model_name: str, rank: int, tokenizer, args) -> dict:
    from tinker import types

    training = service.create_lora_training_client(base_model=model_name, rank=rank).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompts = []
    for g in range(args.groups):
        tokens = chat_tokens(
            tokenizer,
            [
                {"role": "user", "content": "What is 4 + 5?"},
                {"role": "assistant", "content": "9"},
                {"role": "user", "content": f"What is {17 * g % 101} + {31 * g % 101}?"},
            ],
            add_generation_prompt=True,
        )
        prompts += [types.ModelInput.from_ints(tokens)] * args.group_size
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)

    async def batched() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(sampler.sample(p, 1, params) for p in prompts))
        return time.perf_counter() - start

    async def one_by_one() -> float:
        start = time.perf_counter()
        for p in prompts:
            await sampler.sample(p, 1, params)
        return time.perf_counter() - start

    together, alone = [], []
    for _ in range(args.rounds):  # alternating, so load changes touch both sides alike
        together.append(asyncio.run(batched()))
        alone.append(asyncio.run(one_by_one()))
    return {"batched_s": together, "one_per_rollout_s": alone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--model-name", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32, help="conversations per SL step")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="timed SL steps per side (after one warm-up)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", choices=("api", "direct"), help=argparse.SUPPRESS)  # one SL side (sl_side)
    ap.add_argument("--scheduler-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = str(Path(args.model).resolve())  # the scheduler's config and the sides read it elsewhere
    if args.side:
        sl_side(args)
        return

    from transformers import AutoTokenizer

    from tests.support.gateway import Gateway, model_names
    from tests.support.procs import Cluster

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sequences = conversations(tokenizer, args.batch, args.max_length)
    with tempfile.TemporaryDirectory(prefix="bench-tinker-") as tmp:
        cluster = Cluster(Path(tmp), CONFIG + model_names(Path(args.model), args.model_name))
        gateway = None
        try:
            cluster.start_with_trainer()
            gateway = Gateway(Path(tmp), f"127.0.0.1:{cluster.port}")
            os.environ.update(
                TINKER_BASE_URL=gateway.url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1"
            )
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")])}
            api, direct = sl_steps(args, cluster.url, env)
            import tinker

            with tinker.ServiceClient() as service:
                sampled = sampling(service, args.model_name, args.rank, tokenizer, args)
        finally:
            if gateway is not None:
                gateway.close()
            cluster.close()

    sl_ratio = statistics.median(api) / statistics.median(direct)
    sample_ratio = statistics.median(sampled["batched_s"]) / statistics.median(sampled["one_per_rollout_s"])
    tokens = sum(len(s) - 1 for s in sequences)
    print(
        f"SL step ({args.batch} conversations, {tokens} tokens): API {statistics.median(api):.2f} s, "
        f"direct {statistics.median(direct):.2f} s: {sl_ratio:.3f} x (goal <= 1.1)"
    )
    print(
        f"math_rl sampling ({args.groups} x {args.group_size} rollouts, {args.max_tokens} tokens): batched "
        f"{statistics.median(sampled['batched_s']):.2f} s, one per rollout "
        f"{statistics.median(sampled['one_per_rollout_s']):.2f} s: {sample_ratio:.3f} x (goal <= 0.5)"
    )
    settings = {
        k: getattr(args, k)
        for k in ("rank", "batch", "max_length", "steps", "groups", "group_size", "max_tokens", "rounds")
    }
    write_result(
        "tinker-sl-step",
        what="Seconds of a cookbook-shaped SL step (forward_backward + optim_step), median",
        peer="the same datums sent to a lora_session directly with opentinker_client",
        ratios=[{"label": "through the Tinker API / direct", "value": round(sl_ratio, 3)}],
        make="make bench-tinker",
        goal="<= 1.1",
        settings={**settings, "tokens_per_step": tokens},
        notes="tinker 0.38.0 SDK through opentinker_gateway; scheduler, trainer and gateway on loopback; "
        "each side's client a process in its own session with its own session task on one trainer, "
        "steps alternating; Tinker's Adam defaults on both.",
        details={"api_s": api, "direct_s": direct},
    )
    write_result(
        "tinker-math-rl-sampling",
        what="Sampling seconds of a math_rl-shaped step (num_samples=1 per rollout), median",
        peer="one sample call per rollout, each awaited before the next",
        ratios=[{"label": "concurrent sample calls (batched) / one per rollout", "value": round(sample_ratio, 3)}],
        make="make bench-tinker",
        goal="<= 0.5",
        settings=settings,
        notes="From a save_weights_for_sampler snapshot; the gateway sends concurrent requests of the same "
        "parameters to the session's SampleSnapshot together. Rounds alternate the two sides.",
        details=sampled,
    )


if __name__ == "__main__":
    main()
