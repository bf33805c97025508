#!/usr/bin/env python3
"""Inference benchmark on the real SmolLM2-135M-Instruct, all in one process and one run.

1. Throughput: tokens/s of greedy decoding through ``GenerateStream`` (a real gRPC server on
   loopback, the ``InferenceClient`` reading every streamed token) against ``transformers``
   ``model.generate`` on the same model in the same process. Runs alternate, median of
   ``--repeats``; both generate exactly ``--tokens`` tokens (``ignore_eos`` / ``min_new_tokens``).
2. Time to first token: first streamed chunk against ``generate(max_new_tokens=1)``.
3. Resident memory (RSS) with 8 LoRA adapters loaded (rank ``--rank`` on q/k/v/o) against 1.
4. Aggregate tokens/s of 4 concurrent streams against 1 (steps interleave; no cross-request
   batching yet).

Prints one line per figure with its ratio and the goal; exit 0 always (figures, not tests).
Usage: .venv/bin/python scripts/bench_inference.py [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opentinker_client.inference import InferenceClient
    from opentinker_trainer.inference.runtime import ModelRuntime
    from tests.support.inference import ServerThread, greedy_generate

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    messages = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    prompt_ids = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    n = args.tokens
    print(
        f"model {args.model}; prompt {len(prompt_ids)} tokens; {n} "
        f"new tokens, greedy; torch threads {torch.get_num_threads()}",
        flush=True,
    )

    # Adapters for the memory figure (random LoRA B so they are real, distinct adapters).
    tmp = Path(tempfile.mkdtemp(prefix="bench-inference-"))
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(args.model),
        LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    adapters = {}
    for i in range(8):
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
        peft_model.save_pretrained(tmp / f"a{i}")
        adapters[f"task-a{i}"] = tmp / f"a{i}"
    del peft_model

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    runtime = ModelRuntime(
        model_name=args.model,
        tokenizer=tok,
        model=model,
        stop_token_ids=[tok.eos_token_id],
        resolve=lambda name: adapters[name],
    )
    server = ServerThread(runtime)
    client = InferenceClient(server.address, timeout=600)
    ids = torch.tensor([prompt_ids])

    def direct(max_new: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = greedy_generate(model, ids, max_new, tok.eos_token_id)
        assert out.shape[1] - ids.shape[1] == max_new
        return time.perf_counter() - t0

    def streamed(max_new: int, adapter=None) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        first = None
        count = 0
        for chunk in client.generate_stream(
            messages=messages, adapter=adapter, temperature=0, max_tokens=max_new, ignore_eos=True
        ):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            count += len(chunk.token_ids)
        assert count == max_new, count
        return time.perf_counter() - t0, first or 0.0, count

    direct(8), streamed(8)  # warm up both paths
    d_tps, s_tps, d_ttft, s_ttft = [], [], [], []
    for _ in range(args.repeats):
        d_tps.append(n / direct(n))
        total, first, _ = streamed(n)
        s_tps.append(n / total)
        d_ttft.append(direct(1))
        s_ttft.append(streamed(1)[1])
    d, s = statistics.median(d_tps), statistics.median(s_tps)
    print(
        f"throughput: GenerateStream {s:.1f} tok/s vs transformers "
        f"generate {d:.1f} tok/s -> ratio {s / d:.3f} (goal >= 0.95)"
    )
    dt, st = statistics.median(d_ttft), statistics.median(s_ttft)
    print(
        f"time to first token: GenerateStream {st * 1000:.1f} ms vs "
        f"generate(max_new_tokens=1) {dt * 1000:.1f} ms -> added {1000 * (st - dt):+.1f} ms"
    )

    # Memory: 1 adapter resident and used, then 8.
    streamed(4, "task-a0")
    rss1 = rss_bytes()
    for i in range(1, 8):
        streamed(4, f"task-a{i}")
    rss8 = rss_bytes()
    lora_bytes = sum(a.size_bytes for a in client.list_adapters())
    print(
        f"resident memory: 8 adapters {rss8 / 2**20:.0f} MiB vs 1 adapter "
        f"{rss1 / 2**20:.0f} MiB -> ratio {rss8 / rss1:.3f} (goal <= 1.1); "
        f"LoRA tensors of the 8: {lora_bytes / 2**20:.1f} MiB (rank {args.rank}, q/k/v/o)"
    )
    one = statistics.median(n // 2 / streamed(n // 2)[0] for _ in range(2))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: streamed(n // 2, f"task-a{i}"), range(4)))
    four = 4 * (n // 2) / (time.perf_counter() - t0)
    print(
        f"concurrency: 4 streams (4 adapters) {four:.1f} tok/s in all vs 1 stream {one:.1f} "
        f"tok/s -> ratio {four / one:.2f} (steps interleave, no batching across requests)"
    )
    client.close()
    server.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
