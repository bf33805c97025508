#!/usr/bin/env python3
"""Inference benchmark on the real SmolLM2-135M-Instruct, all in one process and one run.

1. Throughput: tokens/s of greedy decoding through ``GenerateStream`` (a real gRPC server on
   loopback, the ``InferenceClient`` reading every streamed token) against ``transformers``
   ``model.generate`` on the same model in the same process. Runs alternate, median of
   ``--repeats``; both generate exactly ``--tokens`` tokens (``ignore_eos`` / ``min_new_tokens``).
2. Time to first token: first streamed chunk against ``generate(max_new_tokens=1)``.
3. Resident memory (RSS) with 8 LoRA adapters loaded (rank ``--rank`` on q/k/v/o) against 1.
4. Continuous batching: aggregate tokens/s and p50/p99 time to first token with 1, 4 and 16
   concurrent streams (closed loop: each stream sends ``--requests`` requests one after the
   other, ``--conc-tokens`` new tokens each; stream ``i`` uses the base model or one of the 8
   adapters in turn), through GenerateStream with per-row ``adapter_names``, with one batch per
   adapter, and with every stream on the base model, against ``transformers``'
   ``ContinuousBatchingManager`` (paged CPU cache) driven the same way, and one padded
   ``model.generate`` batch of the same prompts. Stream ``i`` sends prompt ``i`` of ``PROMPTS``
   on every engine, so no engine gains from a prompt it has already seen. The like-for-like
   comparison with transformers is ours with every stream on the base model against its manager:
   the manager cannot choose an adapter per request, so mixed adapters against it would compare
   more work with less.

Prints one line per figure with its ratio and the goal; exit 0 always (figures, not tests).
Usage: .venv/bin/python scripts/bench_inference.py [--tokens 128] [--repeats 3] [--threads 1]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_bytes(field: str = "VmRSS:") -> int:
    """This process's resident memory now (``VmRSS:``) or at its peak (``VmHWM:``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


#: The prompts of the concurrency runs: stream ``i`` sends ``PROMPTS[i % len(PROMPTS)]`` on every engine.
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright.",
    "List three uses of a paperclip and why each works.",
    "Describe the water cycle to a child.",
    "Write a letter from a lighthouse keeper to the sea.",
    "What makes bread rise? Answer in a paragraph.",
    "Invent a board game and give its rules.",
    "Summarise the plot of a heist film you make up.",
    "Give advice to someone learning to juggle.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the issue's figures: 1)")
    parser.add_argument("--conc-tokens", type=int, default=32, help="new tokens per request in the concurrency runs")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream in the concurrency runs")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--no-single", action="store_true", help="skip figures 1 and 2 (single stream vs generate)")
    parser.add_argument(
        "--engines",
        default="ours,base,cb,padded",
        help="concurrency runs to do: ours (mixed adapters, grouped LoRA), base (every stream the base), "
        "cb (transformers), padded (generate)",
    )
    parser.add_argument("--probes", type=int, default=4, help="requests sent mid-decode per load level (0: none)")
    parser.add_argument(
        "--plain-weights", action="store_true", help="packed_weights: false (the Linear layers as MKL runs them)"
    )
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opentinker_client.inference import InferenceClient
    from opentinker_trainer.inference.runtime import ModelRuntime, RuntimeConfig
    from tests.support.inference import ServerThread, greedy_generate

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
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
        config=RuntimeConfig(packed_weights=not args.plain_weights),
    )
    print(f"resident after load: {rss_bytes() / 2**20:.0f} MiB", flush=True)
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

    if not args.no_single:
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
    figures = concurrency(args, tok, model, runtime, client, adapters)
    client.close()
    server.close()
    settings = {"model": Path(args.model).name, "threads": args.threads, "rank": args.rank}
    if not args.no_single:
        write_result(
            "inference-stream-generate",
            what="GenerateStream over gRPC, one stream, greedy: tokens/s; resident memory with 8 adapters",
            peer="transformers generate on the same model in the same process",
            ratios=[
                {"label": "tokens/s, GenerateStream / generate", "value": round(s / d, 3)},
                {"label": "RSS with 8 LoRA adapters / with 1 (lower is better)", "value": round(rss8 / rss1, 3)},
            ],
            goal=">= 0.95; memory <= 1.1",
            settings={**settings, "tokens": n, "repeats": args.repeats},
            make="make bench-inference",
            details={"ttft_added_ms": round(1000 * (st - dt), 1)},
        )
    c_levels = [int(x) for x in args.streams.split(",")]
    if any(f"cb {c} streams tok/s" in figures for c in c_levels):
        write_result(
            "inference-cb",
            what="Continuous batching, every stream on the base model: tokens/s in all, closed loop",
            peer="transformers ContinuousBatchingManager, same model, prompts and token counts",
            ratios=[
                {
                    "label": f"{c} stream{'s' if c > 1 else ''}, ours / transformers CB",
                    "value": _ratio(figures, "base", "cb", c),
                }
                for c in c_levels
            ],
            goal=">= 1.0",
            settings={**settings, "streams": c_levels, "new_tokens": args.conc_tokens, "requests": args.requests},
            make="make bench-inference",
            notes=(
                "Both sides run in one process and one session, base model only: transformers' manager "
                "cannot choose an adapter per request. Stream i sends prompt i of PROMPTS on both sides."
            ),
            details=figures,
        )
    return 0


def _ratio(figures: dict, ours: str, peer: str, streams: int) -> float | None:
    a, b = figures.get(f"{ours} {streams} streams tok/s"), figures.get(f"{peer} {streams} streams tok/s")
    return round(a / b, 3) if a and b else None


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def closed_loop(streams: int, requests: int, one_request) -> tuple[float, list[float]]:
    """``streams`` threads, each sending ``requests`` requests one after the other through
    ``one_request(stream) -> (tokens, ttft_s)``; returns (tokens/s in all, every TTFT)."""
    ttfts: list[float] = []
    total = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        for got in pool.map(lambda i: [one_request(i) for _ in range(requests)], range(streams)):
            for tokens, ttft in got:
                total += tokens
                ttfts.append(ttft)
    return total / (time.perf_counter() - t0), ttfts


def concurrency(args, tok, model, runtime, client, adapters) -> dict:
    import queue
    import threading

    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    k = args.conc_tokens
    chats = [[{"role": "user", "content": text}] for text in PROMPTS]
    chat_ids = [
        tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        for m in chats
    ]
    names = [None, *adapters]  # stream i: the base or an adapter, in turn
    levels = [int(x) for x in args.streams.split(",")]

    def ours(i: int, *, base_only: bool = False, max_tokens: int | None = None) -> tuple[int, float]:
        t0 = time.perf_counter()
        first, count = None, 0
        adapter = None if base_only else names[i % len(names)]
        for chunk in client.generate_stream(
            messages=chats[i % len(chats)], adapter=adapter, temperature=0, max_tokens=max_tokens or k, ignore_eos=True
        ):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            count += len(chunk.token_ids)
        return count, first or 0.0

    # transformers' continuous batching: one manager, a router thread hands results to the streams.
    gen_cfg = GenerationConfig(max_new_tokens=k, do_sample=False, eos_token_id=-1, pad_token_id=tok.eos_token_id)
    manager = model.init_continuous_batching(
        generation_config=gen_cfg,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=256, page_size=32, max_batch_tokens=1024),
    )
    manager.start()
    inboxes: dict[str, queue.Queue] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def route() -> None:
        while not stop.is_set():
            r = manager.get_result(timeout=0.1)
            if r is not None:
                with lock:
                    box = inboxes.get(r.request_id)
                if box is not None:
                    box.put(r)

    router = threading.Thread(target=route, daemon=True)
    router.start()
    counter = iter(range(10**9))

    def theirs(i: int) -> tuple[int, float]:
        rid = f"bench-{next(counter)}"
        box: queue.Queue = queue.Queue()
        with lock:
            inboxes[rid] = box
        t0 = time.perf_counter()
        manager.add_request(chat_ids[i % len(chat_ids)], request_id=rid, max_new_tokens=k, streaming=True)
        first = None
        while True:
            r = box.get(timeout=600)
            if first is None:
                first = time.perf_counter() - t0
            if r.is_finished():
                with lock:
                    inboxes.pop(rid, None)
                return len(r.generated_tokens), first

    def padded(streams: int) -> tuple[float, float]:
        rows = [chat_ids[i % len(chat_ids)] for i in range(streams)]
        width = max(len(r) for r in rows)  # left-padded, as generate expects for a decoder
        ids = torch.tensor([[tok.eos_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=1, pad_token_id=tok.eos_token_id
            )
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=k,
                min_new_tokens=k,
                pad_token_id=tok.eos_token_id,
            )
            wall = time.perf_counter() - t0
        return streams * (out.shape[1] - ids.shape[1]) / wall, ttft

    def probe_ttft(streams: int) -> list[float]:
        """TTFT of requests that arrive while ``streams`` others decode (mixed adapters): the
        background streams start and get their first tokens, then ``--probes`` requests of one
        token each are sent one after the other, each with the next adapter in turn."""
        if args.probes <= 0:
            return []
        started = threading.Barrier(streams + 1) if streams else None
        done = threading.Event()

        def background(i: int) -> None:
            it = client.generate_stream(
                messages=chats[i % len(chats)],
                adapter=names[i % len(names)],
                temperature=0,
                max_tokens=1024,
                ignore_eos=True,
            )
            next(it)
            started.wait()
            done.wait()
            it.close()

        threads = [threading.Thread(target=background, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        if started is not None:
            started.wait()
        try:
            return [closed_loop(1, 1, lambda _: ours(streams + j, max_tokens=1))[1][0] for j in range(args.probes)]
        finally:
            done.set()
            for t in threads:
                t.join(60)

    def base_model_state() -> None:
        """Leave the shared model as the plain base before transformers' manager runs it: one
        base-only request through our server turns the LoRA layers off and clears the grouped-LoRA
        row plan (else its hooks would add our last batch's adapters to the manager's rows)."""
        ours(0, base_only=True, max_tokens=1)

    engines = set(args.engines.split(","))
    closed_loop(2, 1, ours)  # warm up
    if "cb" in engines:
        base_model_state()
        closed_loop(2, 1, theirs)
    results: dict[tuple[str, int], tuple[float, list[float]]] = {}
    probes: dict[int, list[float]] = {}
    labels = (
        ("ours", "mixed adapters, grouped LoRA"),
        ("base", "ours, every stream the base"),
        ("cb", "transformers CB (base only)"),
        ("padded", "padded generate (base only)"),
    )

    def run_engine(key: str, c: int):
        if key == "base":
            return closed_loop(c, args.requests, lambda i: ours(i, base_only=True))
        if key == "cb":
            base_model_state()
            return closed_loop(c, args.requests, theirs)
        if key == "padded":
            tps, ttft = padded(c)
            return tps, [ttft]
        return closed_loop(c, args.requests, ours)

    order = [e for e in args.engines.split(",") if e]  # as given at the first level, reversed at the next, ...
    for n, c in enumerate(levels):
        for key in order if n % 2 == 0 else order[::-1]:
            results[(key, c)] = run_engine(key, c)
        line = ", ".join(
            f"{label} {results[(key, c)][0]:.1f} tok/s (TTFT p50 {1000 * percentile(results[(key, c)][1], 0.5):.0f} "
            f"p99 {1000 * percentile(results[(key, c)][1], 0.99):.0f} ms)"
            for key, label in labels
            if (key, c) in results
        )
        print(f"{c} streams: {line}", flush=True)
    for c in sorted({0, *(c for c in levels if c <= 4)}):
        probes[c] = probe_ttft(c)
        if probes[c]:
            print(
                f"TTFT of a request arriving while {c} streams decode: "
                + ", ".join(f"{1000 * t:.0f}" for t in probes[c])
                + f" ms (median {1000 * statistics.median(probes[c]):.0f})",
                flush=True,
            )
    stop.set()
    router.join(5)
    manager.stop(block=True, timeout=10)
    print(f"most rows in one step: {runtime.max_batch_rows_seen}")
    print(f"peak resident: {rss_bytes('VmHWM:') / 2**20:.0f} MiB", flush=True)
    goals = {4: 2.2, 16: 4.0}

    def ratio(a, b) -> str:
        return f"{results[a][0] / results[b][0]:.2f}x" if a in results and b in results else "-"

    for c in levels:
        if c == 1:
            continue
        goal = f" (goal >= {goals[c]})" if c in goals else ""
        print(
            f"{c} streams vs 1, mixed adapters: {ratio(('ours', c), ('ours', 1))}{goal}; "
            f"vs transformers CB (goal >= 1.0) {ratio(('ours', c), ('cb', c))}; "
            f"vs padded generate {ratio(('ours', c), ('padded', c))}; ours with every stream on the "
            f"base vs transformers CB (both base only) {ratio(('base', c), ('cb', c))}"
        )
    if 4 in levels and ("ours", 1) in results and ("ours", 4) in results:
        ttft1 = percentile(results[("ours", 1)][1], 0.5)
        ttft4 = percentile(results[("ours", 4)][1], 0.5)
        print(f"TTFT p50 of the closed loop (4 streams asking together) vs 1 stream: {ttft4 / ttft1:.2f}x")
    if probes.get(0) and probes.get(4):
        print(
            "TTFT of a request arriving while 4 streams decode vs arriving idle (medians): "
            f"{statistics.median(probes[4]) / statistics.median(probes[0]):.2f}x (goal <= 1.5)"
        )
    return {f"{key} {c} streams tok/s": round(tps, 2) for (key, c), (tps, _) in results.items()}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
