"""Learning curves of ``full_rl`` PPO: steps to a return threshold and wall time, over seeds,
against stable-baselines3 PPO with the same settings (the peer) where a case has one.

Runs the real workload (``opentinker_trainer.workloads.run_task``) in this process, on the CPU,
for each case and seed, and prints per run: the random-policy baseline measured in the same run
(mean return of the episodes of the first update, when the policy is still near uniform), the
environment steps and wall time until the mean return of the last 20 finished episodes first
reached the threshold (checked after each update, on the finished episodes in step order), the
final 20-episode mean, and wall seconds per 1000 env steps. Per case: the median over seeds of
the steps to the threshold (a seed that never reaches it counts as infinitely many). A learning
curve (env steps, 20-episode mean) is printed at 8 points per run when one seed runs
(``--curve-every N``: every N updates; ``--curves``: for every seed).

    .venv/bin/python scripts/bench_ppo.py                 # all cases, seed 1 (about 8-10 min on 2 cores)
    .venv/bin/python scripts/bench_ppo.py --only cartpole # one case; see --help
    # the rl-zoo CartPole case over 5 seeds against SB3 PPO in its own venv (make bench-ppo-sb3):
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_ppo.py --only cartpole --only cartpole-before \\
        --seeds 1,2,3,4,5 --stop-at-threshold --peer-python /work/peer-venv/bin/python

The peer (``--peer-python PATH``): ``scripts/peer_sb3_ppo.py`` run in that interpreter, which needs
stable-baselines3 (``make bench-ppo-sb3`` says how to make the venv), once per seed for each case
that names a peer, beside our run of that seed, so both see the same machine load. Each run, ours
and the peer's, is a process in its own session: this kernel shares CPU per session, so the two
sides get equal shares. The order alternates by seed (ours first on odd seeds, the peer first on
even ones). The peer measures the same thing (a callback reading Monitor's episode returns, checked
at each rollout's end) and the bench prints ours/SB3 for the median steps and for seconds per 1000
steps. Without ``--peer-python`` the peer is skipped, with a message saying so. Step counts are
deterministic per seed on both sides; the wall times are not.

Cases:
* ``cartpole``: CartPole-v1 with the rl-baselines3-zoo PPO settings for it (``hyperparams/ppo.yml``:
  8 envs x 32 steps, one minibatch of 256, 20 epochs, gamma 0.98, lambda 0.8, no entropy bonus,
  ``learning_rate: lin_0.001``, ``clip_range: lin_0.2``, no value clipping, ``n_timesteps: 1e5``);
  threshold 475 (gymnasium's reward_threshold). Peer: SB3 PPO with those settings.
* ``cartpole-before``: what ``cartpole`` was before ``clip_schedule`` existed: the same settings
  with a constant clip of 0.2, the value loss clipped, 200,000 steps (the lr anneals half as fast).
* ``cartpole-cleanrl``: PPOConfig's defaults (CleanRL ``ppo.py``), 200,000 steps.
* ``acrobot``: Acrobot-v1, 200,000 steps, CleanRL defaults; threshold -100 (reward_threshold).
* ``spread-shared`` / ``spread-independent``: mpe2/simple_spread_v3 (N=3, 25-step episodes),
  150,000 env steps, parameter-shared vs independent PPO; no threshold, improvement over random.

``--set KEY=VALUE`` (repeatable, VALUE in JSON) overrides a hyper-parameter of every case run, for
ablations (e.g. ``--set vf_coef=1.0``); the peer keeps its settings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from opentinker_common.spec import TaskSpecModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = ROOT / "scripts" / "peer_sb3_ppo.py"

#: rl-baselines3-zoo ``hyperparams/ppo.yml``, ``CartPole-v1`` (SB3's names).
ZOO_CARTPOLE_SB3 = {
    "env_id": "CartPole-v1",
    "n_envs": 8,
    "n_timesteps": 1e5,
    "ppo": {
        "policy": "MlpPolicy", "n_steps": 32, "batch_size": 256, "gae_lambda": 0.8, "gamma": 0.98,
        "n_epochs": 20, "ent_coef": 0.0, "learning_rate": "lin_0.001", "clip_range": "lin_0.2",
    },
}  # fmt: skip

#: The same in PPOConfig's names. SB3's defaults that the zoo keeps: vf_coef 0.5, max_grad_norm
#: 0.5, advantages normalised per minibatch, Adam eps 1e-5, separate 64-64 tanh actor and critic,
#: orthogonal init; clip_range_vf None (no value clipping). One minibatch = the whole batch.
ZOO_CARTPOLE = {
    "total_timesteps": 100_000, "num_envs": 8, "num_steps": 32, "num_minibatches": 1, "update_epochs": 20,
    "gamma": 0.98, "gae_lambda": 0.8, "ent_coef": 0.0, "learning_rate": 1e-3, "anneal_lr": True,
    "clip_coef": 0.2, "clip_schedule": "linear", "clip_vloss": False,
}  # fmt: skip

CASES = {
    "cartpole": dict(env={"env_id": "CartPole-v1"}, threshold=475.0, hp=ZOO_CARTPOLE, peer="sb3-zoo-cartpole"),
    "cartpole-before": dict(
        env={"env_id": "CartPole-v1"}, threshold=475.0,
        hp={**ZOO_CARTPOLE, "total_timesteps": 200_000, "clip_schedule": "constant", "clip_vloss": True},
        peer="sb3-zoo-cartpole",
    ),
    "cartpole-cleanrl": dict(env={"env_id": "CartPole-v1"}, threshold=475.0, hp={"total_timesteps": 200_000}),
    "acrobot": dict(env={"env_id": "Acrobot-v1"}, threshold=-100.0, hp={"total_timesteps": 200_000}),
    "spread-shared": dict(
        env={"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 3, "max_cycles": 25}}, threshold=None,
        hp={"total_timesteps": 150_000, "parameter_sharing": True},
    ),
    "spread-independent": dict(
        env={"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 3, "max_cycles": 25}}, threshold=None,
        hp={"total_timesteps": 150_000, "parameter_sharing": False},
    ),
}  # fmt: skip

PEERS = {"sb3-zoo-cartpole": ZOO_CARTPOLE_SB3}


class _Lines(io.TextIOBase):
    """The worker's report channel, parsed as it is written."""

    def __init__(self, on_metric) -> None:
        self.on_metric = on_metric

    def write(self, s: str) -> int:
        for line in s.splitlines():
            msg = json.loads(line)
            if msg["type"] == "metric":
                self.on_metric(msg["step"], msg["values"])
        return len(s)


@contextlib.contextmanager
def _episodes_into(sink: list[float]):
    """Copy every finished episode's return into ``sink`` as the trainer collects them (each
    update's episodes in step order, then stream order), so the window is exact rather than
    rebuilt from per-update means."""
    from opentinker_trainer.workloads import _ppo_common as common

    pop = common.EpisodeTracker.pop

    def tapped(self):
        out = pop(self)
        sink.extend(r for _, r, _ in out)
        return out

    common.EpisodeTracker.pop = tapped
    try:
        yield
    finally:
        common.EpisodeTracker.pop = pop


def run_case(case: dict, seed: int, window: int, curve_every: int, stop_at_threshold: bool, overrides: dict) -> dict:
    from opentinker_trainer.context import WorkerContext
    from opentinker_trainer.workloads import run_task

    hp = {**case["hp"], **overrides, "seed": seed}
    spec = TaskSpecModel.from_parts(workload_type="full_rl", model="-", env_config=case["env"], hyperparameters=hp)
    recent: deque[float] = deque(maxlen=window)
    finished: list[float] = []
    state = {"baseline": math.nan, "hit": None, "curve": [], "final": math.nan, "steps": 0}
    curve_every = curve_every or max(1, spec.hyperparameters.num_updates // 8)
    thr = case["threshold"]
    ctx_box: list = []

    def on_metric(step: int, v: dict) -> None:
        if finished:
            if math.isnan(state["baseline"]):
                state["baseline"] = sum(finished) / len(finished)
            recent.extend(finished)
            finished.clear()
        mean = sum(recent) / len(recent) if recent else math.nan
        state["steps"] = int(v["env_steps"])
        if thr is not None and state["hit"] is None and len(recent) == window and mean >= thr:
            state["hit"] = (int(v["env_steps"]), time.perf_counter() - started)
            if stop_at_threshold:
                ctx_box[0].request_stop()
        if step % curve_every == 0:
            state["curve"].append((int(v["env_steps"]), mean))
        state["final"] = mean

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, _episodes_into(finished):
        ctx = WorkerContext("bench", 1, spec, "cpu", Path(tmp), out=_Lines(on_metric))
        ctx_box.append(ctx)
        run_task(ctx)
    return {"seed": seed, "wall_s": time.perf_counter() - started, **state}


def _last_json_line(argv: list[str], who: str) -> dict:
    """Run ``argv`` as a process in its own session and read the JSON line it prints last."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"{who} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_ours(name: str, seed: int, args: argparse.Namespace) -> dict:
    """Our run of one case and seed, in a process of its own session (``--one-run``)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--only", name, "--seeds", str(seed), "--one-run"]
    argv += ["--window", str(args.window), "--curve-every", str(args.curve_every)]
    argv += ["--stop-at-threshold"] if args.stop_at_threshold else []
    for item in args.set:
        argv += ["--set", item]
    return _last_json_line(argv, f"ours ({name}, seed {seed})")


def run_peer(python: str, peer: str, seed: int, case: dict, window: int, stop_at_threshold: bool) -> dict:
    cfg = {**PEERS[peer], "seed": seed, "threshold": case["threshold"], "window": window}
    cfg["stop_at_threshold"] = stop_at_threshold
    out = _last_json_line([python, str(PEER_SCRIPT), "--config", json.dumps(cfg)], f"peer {peer}")
    return {
        "seed": seed,
        "wall_s": out["wall_s"],
        "baseline": out["random"],
        "hit": (out["hit_steps"], out["hit_s"]) if out["hit_steps"] is not None else None,
        "final": out["final"],
        "steps": out["steps"],
        "curve": [],
        "versions": f"stable-baselines3 {out['sb3']}, torch {out['torch']}",
        "session": out.get("session"),
    }


def run_peer_seed(args: argparse.Namespace, peer: str | None, seed: int, case: dict, peers: dict) -> None:
    """The peer's run of ``seed``, once per peer however many cases name it."""
    if peer is None or seed in {p["seed"] for p in peers.get(peer, [])}:
        return
    p = run_peer(args.peer_python, peer, seed, case, args.window, args.stop_at_threshold)
    _print_run("SB3", p, case["threshold"])
    peers.setdefault(peer, []).append(p)


def _median_steps(runs: list[dict]) -> float:
    return statistics.median([r["hit"][0] if r["hit"] else math.inf for r in runs])


def _s_per_1000(r: dict) -> float:
    return 1000.0 * r["wall_s"] / max(r["steps"], 1)


def _fmt_steps(x: float | None) -> str:
    if x is None:
        return "-"
    return "not reached" if math.isinf(x) else f"{x:,.0f}"


def _print_run(label: str, r: dict, thr) -> None:
    hit_steps, hit_s = r["hit"] if r["hit"] else (None, None)
    reached = f"{hit_steps:,}" if hit_steps is not None else ("not reached" if thr is not None else "-")
    print(
        f"   {label:<10} seed {r['seed']:>3}: random {r['baseline']:8.2f}  steps to thr {reached:>12}  "
        f"time to thr {f'{hit_s:.1f} s' if hit_s is not None else '-':>8}  final mean {r['final']:8.2f}  "
        f"wall {r['wall_s']:6.1f} s  {_s_per_1000(r):.3f} s/1000 steps  ({r['steps']:,} steps run)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append", help="run only this case (repeatable)")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds (default 1)")
    parser.add_argument("--window", type=int, default=20, help="episodes in the running mean")
    parser.add_argument("--stop-at-threshold", action="store_true", help="end each run once it reaches the threshold")
    parser.add_argument("--peer-python", help="interpreter with stable-baselines3 for the SB3 peer (else skipped)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a hyper-parameter")
    parser.add_argument(
        "--curve-every", type=int, default=0, help="print the curve every N updates (0: 8 points per run)"
    )
    parser.add_argument("--curves", action="store_true", help="print the curve of every seed, not only of one")
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)  # one case and seed, as JSON
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    names = args.only or list(CASES)
    if args.one_run:
        r = run_case(CASES[names[0]], seeds[0], args.window, args.curve_every, args.stop_at_threshold, overrides)
        print(json.dumps({**r, "session": os.getsid(0)}))
        return 0
    wanted_peers = {CASES[n].get("peer") for n in names} - {None}
    if wanted_peers and not args.peer_python:
        print(
            f"SB3 peer skipped: no --peer-python given (needed for {', '.join(sorted(wanted_peers))}; "
            "`make bench-ppo-sb3` says how to make the venv)",
            flush=True,
        )
    print(f"seeds {seeds}, window {args.window}, stop at threshold: {args.stop_at_threshold}, overrides {overrides}")
    ours: dict[str, list[dict]] = {}
    peers: dict[str, list[dict]] = {}
    for name in names:
        case = CASES[name]
        peer = case.get("peer") if args.peer_python else None
        print(f"== {name}: {json.dumps(case['env'])} {json.dumps({**case['hp'], **overrides})}", flush=True)
        for seed in seeds:
            peer_first = seed % 2 == 0
            if peer_first:
                run_peer_seed(args, peer, seed, case, peers)
            r = run_ours(name, seed, args)
            _print_run("ours", r, case["threshold"])
            if len(seeds) == 1 or args.curves:
                for steps, mean in r["curve"]:
                    print(f"      {steps:>8d} env steps   mean return (last {args.window}) {mean:9.2f}", flush=True)
            ours.setdefault(name, []).append(r)
            if not peer_first:
                run_peer_seed(args, peer, seed, case, peers)
    print()
    print(f"{'case':<26} {'median steps to thr':>20} {'per seed':<48} {'s/1000 steps':>13} {'gain':>7}")
    rows = [(n, ours[n], CASES[n]) for n in names]
    rows += [(f"SB3 ({p})", runs, {"threshold": CASES[names[0]]["threshold"]}) for p, runs in peers.items()]
    for label, runs, case in rows:
        thr = case["threshold"]
        med = _median_steps(runs) if thr is not None else None
        per_seed = ", ".join(_fmt_steps(r["hit"][0] if r["hit"] else math.inf) for r in runs) if thr else "-"
        gains = [(r["final"] - r["baseline"]) / abs(r["baseline"]) for r in runs if r["baseline"]]
        gain = statistics.median(gains) if gains else math.nan
        s1000 = statistics.median(_s_per_1000(r) for r in runs)
        print(f"{label:<26} {_fmt_steps(med):>20} {per_seed:<48} {s1000:13.3f} {gain:+7.2f}")
    for name in names:
        peer = CASES[name].get("peer")
        if peer in peers:
            mine, theirs = _median_steps(ours[name]), _median_steps(peers[peer])
            ratio = mine / theirs if math.isfinite(mine) and math.isfinite(theirs) else math.nan
            t_ratio = statistics.median(_s_per_1000(r) for r in ours[name]) / statistics.median(
                _s_per_1000(r) for r in peers[peer]
            )
            print(
                f"ours/SB3 {name}: median steps to {CASES[name]['threshold']:g} {ratio:.2f}x, "
                f"seconds per 1000 steps {t_ratio:.2f}x ({peers[peer][0]['versions']})"
            )
            _write_result(name, seeds, overrides, ours[name], peers[peer], ratio, t_ratio)
    return 0


def _write_result(name, seeds, overrides, mine, theirs, ratio, t_ratio) -> None:
    def per_seed(runs):
        return {str(r["seed"]): (r["hit"][0] if r["hit"] else None) for r in runs}

    write_result(
        f"ppo-sb3-{name}",
        what=f"PPO on CartPole-v1 ({name}): env steps until the 20-episode mean return reaches 475, median of seeds",
        peer=f"{theirs[0]['versions']}, rl-baselines3-zoo settings",
        ratios=[
            {"label": "median env steps to 475, ours / SB3 (lower is better)", "value": round(ratio, 3)},
            {"label": "seconds per 1000 env steps, ours / SB3 (lower is better)", "value": round(t_ratio, 3)},
        ],
        goal="steps within seed noise of SB3's",
        settings={
            "seeds": seeds,
            "hyperparameters": {**CASES[name]["hp"], **overrides},
            "peer": PEERS["sb3-zoo-cartpole"],
        },
        make="make bench-ppo-sb3",
        notes=(
            "Step counts per seed are deterministic on both sides and repeat exactly when rerun; "
            "wall times move with the machine's load."
        ),
        details={
            "ours_steps_per_seed": per_seed(mine),
            "sb3_steps_per_seed": per_seed(theirs),
            "ours_s_per_1000": round(statistics.median(_s_per_1000(r) for r in mine), 3),
            "sb3_s_per_1000": round(statistics.median(_s_per_1000(r) for r in theirs), 3),
            "order": [f"{'SB3' if seed % 2 == 0 else 'ours'} first on seed {seed}" for seed in seeds],
            "sessions": {
                "bench": os.getsid(0),
                "ours": [r.get("session") for r in mine],
                "sb3": [r.get("session") for r in theirs],
            },
        },
    )


if __name__ == "__main__":
    sys.exit(main())
