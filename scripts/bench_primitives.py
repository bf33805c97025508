#!/usr/bin/env python3
"""Cost of writing your own loop: training primitives (``TrainingService``) vs the built-in GRPO.

In one process, on the same model, the same batch shape (``--prompts`` problems x ``--group``
samples, ``--max-tokens`` new tokens, temperature 1, LoRA r=16 on q/k/v/o) and seed:

* **built-in GRPO**: the ``lora_finetune`` trainer (``workloads/grpo_text.py``) run in-process as
  a worker runs it; per-step seconds from its ``perf/step_s`` metric;
* **client-side GRPO**: ``examples/own_loop_rl.py``'s ``train`` against a ``lora_session`` server
  (the real servicer, grpc.aio on loopback, the real client with futures); per-step wall seconds
  as the client sees them (sample + reward + forward_backward + optim_step);
* **empty ForwardBackward round trip**: a one-token datum through gRPC (median of ``--calls``),
  against the same call on the session directly (no gRPC) and an empty ``GetInfo`` round trip;
* **sessions at once** (``--sessions``, default 4): that many ``lora_session`` servicers in this
  process, each its own model copy and grpc.aio server on loopback, and as many client threads,
  each running ``own_loop_rl.train`` against its own session at the same time; against one
  session alone (the same code, one thread). Throughput in tokens per second summed over the
  sessions (completion tokens sampled + tokens of the datums sent to ``forward_backward``) over
  the whole run, first step included (from the moment all threads start to the last one's end:
  the sessions drift apart, so there is no common window after the first step), and the ratio
  n sessions / 1; with the memory (resident, MiB) the sessions added to the process;
* **sessions on one host** (``hosted``): the same ``n`` sessions as tenants of one model host
  (one copy of the base model, an adapter and optimizer each, calls in turns), throughput and
  memory against the ``n`` separate copies and the one session alone.

``--phases`` picks the parts (default all: ``builtin,client,sessions``).
In the first two the first step of each loop is left out (warm-up). Prints the figures and the
ratio client-side / built-in (goal <= 1.15). Also prints the mean reward of the first and last 3 steps
of each loop (``--steps`` >= 6 for that to mean anything).

    .venv/bin/python scripts/bench_primitives.py                       # SmolLM2-135M-Instruct
    .venv/bin/python scripts/bench_primitives.py --model /path/tiny --steps 2 --calls 5   # smoke run
    .venv/bin/python scripts/bench_primitives.py --phases sessions --steps 2             # 4 sessions vs 1
    .venv/bin/python scripts/bench_primitives.py --phases sessions,hosted --steps 2      # and on one model host
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_result import write_result  # noqa: E402  (imported at start: it notes the load then)

DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def _ctx(workload: str, model: str, hp: dict, folder: Path, env: dict | None = None):
    from opentinker_common.spec import TaskSpecModel
    from opentinker_trainer.context import WorkerContext

    spec = TaskSpecModel.from_parts(workload_type=workload, model=model, env_config=env or {}, hyperparameters=hp)
    return WorkerContext(
        task_id=f"bench-{workload}", attempt=1, spec=spec, device="cpu", checkpoint_dir=folder, out=io.StringIO()
    )


def builtin_grpo(args, folder: Path) -> tuple[list[float], list[float]]:
    from opentinker_trainer.workloads import grpo_text

    hp = {
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "max_new_tokens": args.max_tokens,
        "temperature": 1.0,
        "learning_rate": args.lr,
        "lora_rank": 16,
        "seed": args.seed,
        "checkpoint_every": 0,
    }
    ctx = _ctx("lora_finetune", args.model, hp, folder / "builtin", env={"env_id": "arithmetic"})
    grpo_text.run(ctx)
    lines = [json.loads(x) for x in ctx.out.getvalue().splitlines() if x.strip()]
    metrics = [x["values"] for x in lines if x["type"] == "metric"]
    return [m["perf/step_s"] for m in metrics], [m["reward"] for m in metrics]


class Served:
    def __init__(self, session) -> None:
        from opentinker_trainer.training.sequencing import Sequencer
        from opentinker_trainer.training.server import TrainingServicer, start_training_server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        servicer = TrainingServicer(session, sequencer=Sequencer(0))
        self.running = asyncio.run_coroutine_threadsafe(
            start_training_server(servicer, host="127.0.0.1"), self.loop
        ).result(60)
        self.address = f"127.0.0.1:{self.running.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def client_side(args, folder: Path):
    from opentinker_client.training import Datum, TrainingSession
    from opentinker_trainer.workloads.lora_session import open_session

    own_loop = _own_loop()
    hp = {"lora_rank": 16, "lora_alpha": 32.0, "seed": args.seed}
    session, _ = open_session(_ctx("lora_session", args.model, hp, folder / "session"))
    served = Served(session)
    try:
        client = TrainingSession(served.address, api_key="")
        stamps = [time.perf_counter()]

        def log(line: str) -> None:
            stamps.append(time.perf_counter())
            print("  client-side", line, flush=True)

        rewards = own_loop.train(
            client,
            steps=args.steps,
            problems_per_step=args.prompts,
            group_size=args.group,
            max_tokens=args.max_tokens,
            learning_rate=args.lr,
            seed=args.seed,
            log=log,
        )
        step_s = [b - a for a, b in zip(stamps, stamps[1:])]
        one = Datum([5], [6], advantages=[0.0], sampling_logprobs=[0.0])
        rtt, info, direct = [], [], []
        for _ in range(args.calls):
            t = time.perf_counter()
            client.forward_backward([one], "importance_sampling").result()
            rtt.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.get_info()
            info.append(time.perf_counter() - t)
        from opentinker_trainer.training.datums import Datum as ServerDatum

        for _ in range(args.calls):
            t = time.perf_counter()
            session.forward_backward([ServerDatum([5], [6], (), [0.0], [0.0])], "importance_sampling")
            direct.append(time.perf_counter() - t)
        client.close()
    finally:
        served.close()
    return step_s, rewards, rtt, info, direct


def _own_loop():
    spec = importlib.util.spec_from_file_location("own_loop_rl", ROOT / "examples" / "own_loop_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CountingSession:
    """A client ``TrainingSession`` that counts the tokens the session works on (``tokens``, a
    running total): each completion token it samples, and each token of the datums sent to
    ``forward_backward`` (GRPO trains only the groups whose rewards differ)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, *args, **kwargs):
        future = self.inner.sample(*args, **kwargs)
        counter = self

        class Counted:
            def result(self, timeout=None):
                out = future.result(timeout=timeout)
                counter.tokens += sum(len(s.tokens) for s in out.samples)
                return out

        return Counted()

    def forward_backward(self, datums, *args, **kwargs):
        self.tokens += sum(len(d.input_tokens) for d in datums)
        return self.inner.forward_backward(datums, *args, **kwargs)


def _rss_mib() -> float:
    """Resident memory of this process, MiB (``/proc/self/statm``)."""
    import os

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def separate_sessions(args, folder: Path, n: int) -> list:
    """``n`` sessions, each its own model copy and server (as ``n`` workers would hold them)."""
    from opentinker_trainer.workloads.lora_session import open_session

    hp = {"lora_rank": 16, "lora_alpha": 32.0, "seed": args.seed}
    served = []
    for i in range(n):
        session, _ = open_session(_ctx("lora_session", args.model, hp, folder / f"sessions{n}-{i}"))
        served.append(Served(session))
    return served


def sessions_at_once(args, folder: Path, n: int) -> tuple[float, list[list[float]]]:
    """``(tokens per second over all steps, per-session step seconds)`` of ``n`` separate
    sessions (:func:`separate_sessions`) trained at the same time, each by its own client thread."""
    served = []
    try:
        served = separate_sessions(args, folder, n)
        return _train_at_once(args, [s.address for s in served])
    finally:
        for s in served:
            s.close()


def hosted_sessions(args, folder: Path, n: int):
    """``(host, addresses)``: ``n`` sessions as tenants of one model host, serving."""
    from opentinker.common.v1 import common_pb2
    from opentinker.node.v1 import node_pb2
    from opentinker_trainer.host import ModelHost

    out = io.StringIO()
    host = ModelHost(args.model, "cpu", "auto", out)
    ids = [f"hosted{n}-{i}" for i in range(n)]
    for task_id in ids:
        spec = common_pb2.TaskSpec(workload_type="lora_session", model=args.model)
        spec.hyperparameters.update({"lora_rank": 16, "lora_alpha": 32.0, "seed": args.seed})
        path = folder / f"{task_id}.pb"
        path.write_bytes(node_pb2.AssignTask(task_id=task_id, attempt=1, spec=spec).SerializeToString())
        host.add(path, folder / task_id)
    addresses: dict[str, str] = {}
    while len(addresses) < n:
        for line in out.getvalue().splitlines():
            r = json.loads(line) if line.strip() else {}
            if r.get("type") == "endpoint":
                addresses[r["task_id"]] = r["address"]
            elif r.get("type") == "failed":
                host.stop_all()
                raise RuntimeError(f"session {r.get('task_id')} failed on the host: {r.get('error')}")
        time.sleep(0.1)
    return host, [addresses[t] for t in ids]


def memory_of(args, kind: str, n: int) -> float:
    """Resident MiB of a fresh process holding ``n`` sessions (``kind`` ``separate`` or
    ``hosted``), serving, before any call: this script run again with ``--memory-of``."""
    import subprocess

    out = subprocess.run(
        [sys.executable, __file__, "--model", args.model, "--memory-of", f"{kind}:{n}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def sessions_on_host(args, folder: Path, n: int) -> tuple[float, list[list[float]]]:
    """As :func:`sessions_at_once`, the ``n`` sessions tenants of one model host
    (:class:`opentinker_trainer.host.ModelHost`): one copy of the base, an adapter and optimizer
    each, every call in its tenant's turn, the servers in this process as in a host's."""
    host, addresses = hosted_sessions(args, folder, n)
    try:
        return _train_at_once(args, addresses)
    finally:
        host.stop_all()
        host.join()


def _train_at_once(args, addresses: list[str]) -> tuple[float, list[list[float]]]:
    """Train one session per address at the same time, each by its own client thread running
    ``own_loop_rl.train``; ``(tokens per second, per-session step seconds)``."""
    from opentinker_client.training import TrainingSession

    own_loop = _own_loop()
    n = len(addresses)
    steps: list[list[tuple[float, float, int]]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def one(i: int) -> None:
        client = CountingSession(TrainingSession(addresses[i], api_key=""))
        try:
            start.wait()
            mark = [time.perf_counter(), 0]

            def log(_line: str) -> None:
                now = time.perf_counter()
                steps[i].append((mark[0], now, client.tokens - mark[1]))
                mark[:] = [now, client.tokens]

            own_loop.train(
                client,
                steps=args.steps,
                problems_per_step=args.prompts,
                group_size=args.group,
                max_tokens=args.max_tokens,
                learning_rate=args.lr,
                seed=args.seed + i,
                log=log,
            )
        except BaseException as exc:  # reported after the join
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    # Every step, from the start (all threads released at once) to the last session's end: the
    # sessions drift apart, so "the steps after the first" are no common window.
    begin = min(st[0][0] for st in steps)
    end = max(st[-1][1] for st in steps)
    tokens = sum(x[2] for st in steps for x in st)
    return tokens / (end - begin), [[b - a for a, b, _ in st] for st in steps]


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--sessions", type=int, default=4, help="sessions trained at once (the last phase)")
    p.add_argument("--memory-of", default="", help=argparse.SUPPRESS)  # KIND:N, the child of memory_of()
    p.add_argument(
        "--phases", default="builtin,client,sessions", help="comma-separated: builtin, client, sessions, hosted"
    )
    args = p.parse_args()
    if args.memory_of:
        kind, n = args.memory_of.split(":")
        with tempfile.TemporaryDirectory(prefix="bench-primitives-memory-") as tmp:
            held = (separate_sessions if kind == "separate" else hosted_sessions)(args, Path(tmp), int(n))
            print(f"{_rss_mib():.1f}", flush=True)
            del held
            import os

            os._exit(0)  # the servers' threads need no goodbye
    phases = set(args.phases.split(","))
    if not phases or phases - {"builtin", "client", "sessions", "hosted"} or args.steps < 2 or args.sessions < 2:
        p.error(
            "--phases: builtin, client, sessions and/or hosted; --steps >= 2 (the first is left out); --sessions >= 2"
        )
    if not Path(args.model).exists():
        print(f"{args.model} does not exist (make install prepares SmolLM2-135M-Instruct)", file=sys.stderr)
        return 2
    import torch

    print(
        f"model {args.model}; {args.prompts} x {args.group} samples, {args.max_tokens} tokens, "
        f"{args.steps} steps, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-primitives-") as tmp:
        folder = Path(tmp)
        if "builtin" in phases:
            b_steps, b_rewards = builtin_grpo(args, folder)
            print("built-in step_s", [round(x, 2) for x in b_steps], flush=True)
        if "client" in phases:
            c_steps, c_rewards, rtt, info, direct = client_side(args, folder)
        if "sessions" in phases:
            alone, alone_steps = sessions_at_once(args, folder, 1)
            print("1 session step_s", [[round(x, 2) for x in st] for st in alone_steps], flush=True)
            together, together_steps = sessions_at_once(args, folder, args.sessions)
            print(f"{args.sessions} sessions step_s", [[round(x, 2) for x in st] for st in together_steps], flush=True)
        if "hosted" in phases:
            mib = {
                "1 session": memory_of(args, "separate", 1),
                f"{args.sessions} separate": memory_of(args, "separate", args.sessions),
                f"{args.sessions} on one host": memory_of(args, "hosted", args.sessions),
            }
            print("resident MiB of a process holding them:", {k: round(v) for k, v in mib.items()}, flush=True)
            hosted, hosted_steps = sessions_on_host(args, folder, args.sessions)
            print(
                f"{args.sessions} sessions on one host step_s",
                [[round(x, 2) for x in st] for st in hosted_steps],
                flush=True,
            )
    if "builtin" in phases and "client" in phases:
        b, c = _mean(b_steps[1:]), _mean(c_steps[1:])
        print(f"per step (first left out): built-in GRPO {b:.2f} s, client-side GRPO {c:.2f} s, ratio {c / b:.2f}x")
        write_result(
            "primitives-own-loop",
            what="Your own GRPO loop on the training primitives: seconds per step",
            peer="the built-in GRPO, same model, batch shape and seed",
            ratios=[{"label": "s/step, own loop / built-in (lower is better)", "value": round(c / b, 3)}],
            goal="<= 1.15x",
            settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            make="make bench-primitives",
            notes="Both loops run in this one process, one after the other, the built-in first; the first step of "
            "each is left out.",
            details={"builtin_s_per_step": round(b, 2), "client_s_per_step": round(c, 2)},
        )
    if "builtin" in phases:
        print(f"reward first-3 / last-3: built-in {_mean(b_rewards[:3]):.3f} / {_mean(b_rewards[-3:]):.3f}")
    if "client" in phases:
        print(f"reward first-3 / last-3: client-side {_mean(c_rewards[:3]):.3f} / {_mean(c_rewards[-3:]):.3f}")
        print(
            f"one-token ForwardBackward: gRPC round trip p50 {statistics.median(rtt) * 1e3:.1f} ms, "
            f"in-process {statistics.median(direct) * 1e3:.1f} ms, empty GetInfo round trip "
            f"{statistics.median(info) * 1e3:.1f} ms ({args.calls} calls each)"
        )
    if "sessions" in phases:
        print(
            f"tokens/s (sampled + trained, all steps): 1 session {alone:.0f}, "
            f"{args.sessions} sessions at once {together:.0f} in all, ratio {together / alone:.2f}x"
        )
    if "hosted" in phases:
        k = args.sessions
        one, separate, shared = mib["1 session"], mib[f"{k} separate"], mib[f"{k} on one host"]
        line = (
            f"{k} sessions on one model host: tokens/s {hosted:.0f} in all; resident memory {shared:.0f} MiB = "
            f"{shared / one:.2f}x one session's {one:.0f} MiB ({k} separate copies: {separate:.0f} MiB, "
            f"{separate / one:.2f}x)"
        )
        if "sessions" in phases:
            line += f"; throughput vs {k} separate copies {hosted / together:.2f}x, vs 1 session {hosted / alone:.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
