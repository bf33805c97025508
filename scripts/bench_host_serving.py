#!/usr/bin/env python3
"""Serving from the model host a LoRA task trains on vs a separate inference worker (CPU).

Runs the trainer's own processes with no scheduler (as ``bench_multitenant.py`` does): a model
host (``python -m opentinker_trainer.host``) with one LoRA GRPO tenant training, and an
``inference`` task either as a second tenant of that host (**shared**: no second copy of the
base) or as its own worker process (**separate**: it loads the base again). While the LoRA task
trains, ``--requests`` greedy Generate calls of ``--tokens`` tokens each (``ignore_eos``) go to the
inference endpoint one after another. Measured in one run, reported as ratios:

* **memory**: the peak summed resident set size (RSS, ``/proc/PID/status`` every 0.2 s) of the
  host, or of the host and the worker; separate / shared is what the shared base saves;
* **request seconds**: the median time of one Generate call; shared / separate is what taking
  turns with the training steps costs a response (on a 2-core machine the separate worker
  competes for the same cores instead).

Usage::

    .venv/bin/python scripts/bench_host_serving.py                    # SmolLM2-135M-Instruct
    .venv/bin/python scripts/bench_host_serving.py --model /tmp/tiny --requests 3   # smoke run
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multitenant import DEFAULT_MODEL, ROOT, Lines, Peak, add, assignment, child_env, start_host  # noqa: E402
from bench_result import write_result  # noqa: E402

TRAIN_HP = {"steps": 100000, "prompts_per_step": 1, "group_size": 2, "max_new_tokens": 8, "lora_rank": 8}


def serving_assignment(folder: Path, task_id: str, model: str) -> Path:
    from opentinker.common.v1 import common_pb2
    from opentinker.node.v1 import node_pb2

    spec = common_pb2.TaskSpec(workload_type="inference", model=model)
    spec.hyperparameters.update({"ttl_s": 3600})
    path = folder / f"{task_id}.pb"
    path.write_bytes(node_pb2.AssignTask(task_id=task_id, attempt=1, spec=spec).SerializeToString())
    return path


def requests(endpoint: str, n: int, tokens: int) -> list[float]:
    from opentinker_client import InferenceClient

    took = []
    with InferenceClient(endpoint, timeout=600) as llm:
        for _ in range(n):
            t0 = time.perf_counter()
            out = llm.generate("What is 2 + 3?", temperature=0, max_tokens=tokens, ignore_eos=True)
            took.append(time.perf_counter() - t0)
            assert len(out.samples[0].token_ids) == tokens
    return took


def run(model: str, work: Path, *, shared: bool, n: int, tokens: int) -> dict:
    proc, lines, _ = start_host(model, work)
    train = assignment(work, "train", model, {**TRAIN_HP, "seed": 1})
    add(proc, train, work / "ck" / "train")
    lines.wait(lambda m: m["type"] == "metric" and m.get("task_id") == "train")  # training is under way
    serve = serving_assignment(work, "serve", model)
    worker = None
    if shared:
        add(proc, serve, work / "ck" / "serve")
        _, msg = lines.wait(lambda m: m["type"] == "endpoint" and m.get("task_id") == "serve")
        peak = Peak(lambda: [proc.pid])
    else:
        worker = subprocess.Popen(
            [sys.executable, "-m", "opentinker_trainer.worker", str(serve), "--checkpoint-dir", str(work / "ck" / "s")],
            stdout=subprocess.PIPE,
            stderr=open(work / "serve-worker.log", "w"),
            text=True,
            env=child_env(),
            cwd=ROOT,
        )
        _, msg = Lines(worker).wait(lambda m: m["type"] in ("endpoint", "failed"))
        peak = Peak(lambda: [proc.pid, worker.pid])
    steps_before = sum(1 for _, m in lines.lines if m["type"] == "metric")
    took = requests(msg["address"], n, tokens)
    steps = sum(1 for _, m in lines.lines if m["type"] == "metric") - steps_before
    rss = peak.stop()
    if worker is not None:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
    proc.stdin.close()  # every tenant stops at its next step boundary
    proc.wait(timeout=300)
    return {"rss": rss, "request_s": statistics.median(took), "train_steps_meanwhile": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-host-serving-") as tmp:
        work = Path(tmp)
        got = {}
        for name in ("shared", "separate"):
            (work / name).mkdir()
            got[name] = run(args.model, work / name, shared=name == "shared", n=args.requests, tokens=args.tokens)
            r = got[name]
            print(
                f"{name:9s} peak RSS {r['rss'] / 2**20:.0f} MiB, median request {r['request_s']:.3f} s "
                f"({args.tokens} tokens), training steps meanwhile {r['train_steps_meanwhile']}",
                flush=True,
            )
    shared, separate = got["shared"], got["separate"]
    print(f"memory separate / shared: {separate['rss'] / shared['rss']:.2f}x")
    print(f"request seconds shared / separate: {shared['request_s'] / separate['request_s']:.2f}x")
    print(json.dumps(got))
    write_result(
        "host-serving",
        what="An inference task as a tenant of the model host a LoRA task trains on: peak RSS, Generate seconds",
        peer="the inference task in its own worker process beside the training one",
        ratios=[
            {
                "label": "peak RSS, separate / shared (higher is better)",
                "value": round(separate["rss"] / shared["rss"], 3),
            },
            {
                "label": "median Generate seconds, shared / separate",
                "value": round(shared["request_s"] / separate["request_s"], 3),
            },
        ],
        settings={"requests": args.requests, "tokens": args.tokens, "train": TRAIN_HP},
        make="make bench-host-serving",
        details=got,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
