#!/usr/bin/env python3
"""Inference benchmark on the real SmolLM2-135M-Instruct.

Part ``stream``, in this process:

1. Throughput: tokens/s of greedy decoding through ``GenerateStream`` (a real gRPC server on
   loopback, the ``InferenceClient`` reading every streamed token) against ``transformers``
   ``model.generate`` on the same model in the same process. Runs alternate, median of
   ``--repeats``; both generate exactly ``--tokens`` tokens (``ignore_eos`` / ``min_new_tokens``).
2. Time to first token: first streamed chunk against ``generate(max_new_tokens=1)``.
3. Resident memory (RSS) with 8 LoRA adapters loaded (rank ``--rank`` on q/k/v/o) against 1.

Part ``cb``, continuous batching: ours (``GenerateStream`` through a loopback gRPC server) against
``transformers``' ``ContinuousBatchingManager`` at 1, 4 and 16 concurrent streams. Each side runs
in a process of its own, started in a session of its own (the kernel shares CPU per session),
``--cb-repeats`` times in ABBA order. A side's process loads the model, warms up, then runs a
closed loop at each stream count: each stream sends its requests one after the other, greedy,
``--conc-tokens`` new tokens each, EOS ignored, and stream ``i`` sends prompt ``i`` of ``PROMPTS``
on both sides. It records tokens/s in all, each request's time to first token, and its peak
resident memory per point (psutil, sampled every 20 ms). Both sides serve the base model: the
manager cannot choose an adapter per request. Figures: medians over the repeats.

Prints one line per figure with its ratio and the goal; exit 0 always (figures, not tests).
Usage: .venv/bin/python scripts/bench_inference.py [--parts stream,cb] [--cb-repeats 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import threading
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
    parser.add_argument("--conc-tokens", type=int, default=64, help="new tokens per request in the concurrency runs")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream in the concurrency runs")
    parser.add_argument("--min-requests", type=int, default=4, help="requests per point at least, in all streams")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--cb-repeats", type=int, default=4, help="processes per side, in ABBA order")
    parser.add_argument(
        "--parts",
        default="stream,cb",
        help="figures to measure: stream (one stream against generate, memory with 8 adapters against 1), "
        "cb (continuous batching against transformers')",
    )
    parser.add_argument(
        "--plain-weights", action="store_true", help="packed_weights: false (the Linear layers as MKL runs them)"
    )
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--side-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return run_side(args)
    parts = set(args.parts.split(","))
    if "cb" in parts:
        concurrency(args)
    if "stream" not in parts:
        return 0

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
    client.close()
    server.close()
    settings = {"model": Path(args.model).name, "threads": args.threads, "rank": args.rank}
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
        notes=(
            "Both sides share one process, started from the same shell: the server (its event loop and "
            "model thread) and its client stay up while transformers' generate runs between their "
            "requests, alternating, medians over the repeats. generate runs on the served model object, "
            "so on its packed weights too. The memory ratio is ours alone."
        ),
        details={
            "tok/s GenerateStream, generate": [round(s, 2), round(d, 2)],
            "tok/s ratio per repeat": [round(a / b, 3) for a, b in zip(s_tps, d_tps)],
            "ttft_added_ms": round(1000 * (st - dt), 1),
        },
    )
    return 0


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


def requests_per_stream(args, streams: int) -> int:
    """Each stream sends ``--requests`` requests, more when the point would have fewer than
    ``--min-requests`` in all."""
    return max(args.requests, math.ceil(args.min_requests / streams))


def chat_prompts(tok) -> tuple[list[list[dict]], list[list[int]]]:
    """The chats of ``PROMPTS`` and their token ids as the chat template renders them."""
    chats = [[{"role": "user", "content": text}] for text in PROMPTS]
    ids = [
        tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        for m in chats
    ]
    return chats, ids


class PeakRss:
    """The most resident memory of this process seen by psutil since the last ``reset``, sampled
    every ``period`` seconds by a daemon thread."""

    def __init__(self, period: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._period = period
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._period)

    def reset(self) -> int:
        """Start a new peak at the memory now; return it."""
        self.peak = self._proc.memory_info().rss
        return self.peak


def run_side(args) -> int:
    """One side of the continuous-batching comparison, alone in this process: load the model,
    warm up, run the closed loop at each stream count; write tokens/s, every TTFT and the peak
    RSS per point, and the RSS after load, as JSON to ``--side-out``."""
    import json
    import queue

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    k = args.conc_tokens
    levels = [int(x) for x in args.streams.split(",")]
    memory = PeakRss()
    tok = AutoTokenizer.from_pretrained(args.model)
    chats, chat_ids = chat_prompts(tok)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    closers = []

    if args.side == "ours":
        from opentinker_client.inference import InferenceClient
        from opentinker_trainer.inference.runtime import ModelRuntime, RuntimeConfig
        from tests.support.inference import ServerThread

        runtime = ModelRuntime(
            model_name=args.model,
            tokenizer=tok,
            model=model,
            stop_token_ids=[tok.eos_token_id],
            config=RuntimeConfig(packed_weights=not args.plain_weights),
        )
        server = ServerThread(runtime)
        client = InferenceClient(server.address, timeout=600)
        closers += [client.close, server.close]

        def decode_counts() -> list[int]:
            return [runtime.decode_tokens, runtime.decode_steps, runtime.drafted_tokens, runtime.kept_draft_tokens]

        def one(i: int, n: int) -> tuple[int, float]:
            t0 = time.perf_counter()
            first, count = None, 0
            for chunk in client.generate_stream(
                messages=chats[i % len(chats)], temperature=0, max_tokens=n, ignore_eos=True
            ):
                if chunk.token_ids and first is None:
                    first = time.perf_counter() - t0
                count += len(chunk.token_ids)
            assert count == n, count
            return count, first or 0.0

    else:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        def decode_counts() -> None:
            return None

        # Pages for every stream's prompt and new tokens at the largest stream count, and no more:
        # a larger cache would only add to this side's resident memory.
        page = 32
        longest = max(len(x) for x in chat_ids) + k
        blocks = max(levels) * (math.ceil(longest / page) + 1)
        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(
                max_new_tokens=k, do_sample=False, eos_token_id=-1, pad_token_id=tok.eos_token_id
            ),
            continuous_batching_config=ContinuousBatchingConfig(
                num_blocks=blocks, page_size=page, max_batch_tokens=1024
            ),
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

        def one(i: int, n: int) -> tuple[int, float]:
            rid = f"bench-{next(counter)}"
            box: queue.Queue = queue.Queue()
            with lock:
                inboxes[rid] = box
            t0 = time.perf_counter()
            manager.add_request(chat_ids[i % len(chat_ids)], request_id=rid, max_new_tokens=n, streaming=True)
            first = None
            while True:
                r = box.get(timeout=600)
                if first is None:
                    first = time.perf_counter() - t0
                if r.is_finished():
                    with lock:
                        inboxes.pop(rid, None)
                    assert len(r.generated_tokens) == n, len(r.generated_tokens)
                    return n, first

        def close_manager() -> None:
            stop.set()
            router.join(5)
            manager.stop(block=True, timeout=10)

        closers.append(close_manager)

    rss_load = memory.reset()
    closed_loop(2, 1, lambda i: one(i, 8))  # warm up
    points = {}
    for c in levels:
        memory.reset()
        before = decode_counts()
        tps, ttfts = closed_loop(c, requests_per_stream(args, c), lambda i: one(i, k))
        points[str(c)] = {"tok_s": tps, "ttft_s": ttfts, "peak_rss": memory.peak}
        if before is not None:  # ours: decode tokens per decode step, draft tokens checked and kept
            points[str(c)]["decode"] = [b - a for a, b in zip(before, decode_counts())]
        print(f"{args.side}: {c} streams {tps:.1f} tok/s, TTFT p50 {1000 * percentile(ttfts, 0.5):.0f} ms", flush=True)
    for close in closers:
        close()
    out = {"rss_after_load": rss_load, "points": points, "session": os.getsid(0)}
    Path(args.side_out).write_text(json.dumps(out))
    return 0


#: The two sides of the continuous-batching comparison, by the name ``--side`` takes.
SIDES = {"ours": "ours (GenerateStream over loopback gRPC)", "cb": "transformers ContinuousBatchingManager"}


def concurrency(args) -> None:
    """Each side in its own process and session (``setsid``), ``--cb-repeats`` times in ABBA
    order; medians per stream count; writes ``inference-cb``."""
    import json
    import subprocess

    import grpc  # noqa: F401 - imported for their versions in the result's machine record
    import torch  # noqa: F401
    import transformers  # noqa: F401

    levels = [int(x) for x in args.streams.split(",")]
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    tmp = Path(tempfile.mkdtemp(prefix="bench-cb-"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    for r in range(args.cb_repeats):
        for side in ("ours", "cb") if r % 2 == 0 else ("cb", "ours"):
            out = tmp / f"{side}-{r}.json"
            cmd = [sys.executable, __file__, "--side", side, "--side-out", str(out), "--model", args.model]
            cmd += ["--threads", str(args.threads), "--conc-tokens", str(args.conc_tokens), "--streams", args.streams]
            cmd += ["--requests", str(args.requests), "--min-requests", str(args.min_requests)]
            cmd += ["--plain-weights"] if args.plain_weights else []
            print(f"repeat {r + 1}/{args.cb_repeats}, {SIDES[side]}, load {os.getloadavg()[0]:.1f}", flush=True)
            subprocess.run(cmd, check=True, start_new_session=True, env=env)
            runs[side].append(json.loads(out.read_text()))

    sessions = [run["session"] for side in SIDES for run in runs[side]]
    if len(set(sessions)) != len(sessions) or os.getsid(0) in sessions:
        raise RuntimeError(f"a side ran outside a session of its own: sessions {sessions}")

    def med(side: str, c: int, key: str) -> float:
        return statistics.median(run["points"][str(c)][key] for run in runs[side])

    def ttft_p50(side: str, c: int) -> float:
        return percentile([t for run in runs[side] for t in run["points"][str(c)]["ttft_s"]], 0.5)

    def peak(side: str) -> float:
        return statistics.median(max(p["peak_rss"] for p in run["points"].values()) for run in runs[side])

    details: dict = {}
    ratios = []
    for c in levels:
        ours, theirs = med("ours", c, "tok_s"), med("cb", c, "tok_s")
        pairs = [a["points"][str(c)]["tok_s"] / b["points"][str(c)]["tok_s"] for a, b in zip(runs["ours"], runs["cb"])]
        t_ours, t_cb = ttft_p50("ours", c), ttft_p50("cb", c)
        ratios.append(
            {
                "label": f"{c} stream{'s' if c > 1 else ''}, tokens/s ours / transformers CB",
                "value": round(ours / theirs, 3),
            }
        )
        details[f"{c} streams tok/s ours, cb"] = [round(ours, 2), round(theirs, 2)]
        tokens, steps, drafted, kept = (
            sum(run["points"][str(c)]["decode"][i] for run in runs["ours"]) for i in range(4)
        )
        details[f"{c} streams ours: tokens per decode step, draft tokens checked, kept"] = [
            round(tokens / max(steps, 1), 3),
            drafted,
            kept,
        ]
        details[f"{c} streams tok/s ratio per repeat"] = [round(x, 3) for x in pairs]
        details[f"{c} streams TTFT p50 ms ours, cb"] = [round(1000 * t_ours, 1), round(1000 * t_cb, 1)]
        print(
            f"{c} streams: ours {ours:.1f} tok/s vs transformers CB {theirs:.1f} -> {ours / theirs:.2f}x "
            f"(repeats {', '.join(f'{x:.2f}' for x in pairs)}); TTFT p50 {1000 * t_ours:.0f} vs {1000 * t_cb:.0f} ms",
            flush=True,
        )
    mem_ours, mem_cb = peak("ours"), peak("cb")
    load_ours = statistics.median(run["rss_after_load"] for run in runs["ours"])
    load_cb = statistics.median(run["rss_after_load"] for run in runs["cb"])
    ratios.append({"label": "peak RSS, ours / transformers CB (lower is better)", "value": round(mem_ours / mem_cb, 3)})
    ratios.append(
        {
            "label": "TTFT p50 at 1 stream, ours / transformers CB (lower is better)",
            "value": round(ttft_p50("ours", levels[0]) / ttft_p50("cb", levels[0]), 3),
        }
    )
    details["side processes, each in a session of its own"] = len(sessions)
    details["peak RSS MiB ours, cb"] = [round(mem_ours / 2**20), round(mem_cb / 2**20)]
    details["RSS after load MiB ours, cb"] = [round(load_ours / 2**20), round(load_cb / 2**20)]
    print(
        f"peak RSS: ours {mem_ours / 2**20:.0f} MiB vs transformers CB {mem_cb / 2**20:.0f} MiB -> "
        f"{mem_ours / mem_cb:.2f}x (after load {load_ours / 2**20:.0f} vs {load_cb / 2**20:.0f} MiB)",
        flush=True,
    )
    write_result(
        "inference-cb",
        what="Continuous batching on the base model: tokens/s in all (closed loop), TTFT, peak RSS",
        peer="transformers ContinuousBatchingManager, same model and prompts, greedy, same new tokens",
        ratios=ratios,
        goal=">= 1.2 tokens/s at each stream count; peak RSS <= 1.1",
        settings={
            "model": Path(args.model).name,
            "threads": args.threads,
            "streams": levels,
            "new_tokens": args.conc_tokens,
            "requests_per_stream": {c: requests_per_stream(args, c) for c in levels},
            "repeats": args.cb_repeats,
        },
        make="make bench-inference",
        notes=(
            "Each side runs in its own process and session, in ABBA order over the repeats; medians over "
            "the repeats. Base model on both sides: transformers' manager cannot choose an adapter per "
            "request. Stream i sends prompt i of PROMPTS on both sides. The manager's paged cache holds "
            "the largest point's prompts and new tokens; our cache grows with the batch."
        ),
        details=details,
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
