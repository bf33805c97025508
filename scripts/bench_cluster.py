"""Failover on simulated hosts: kill -9 of the leader to the first acknowledged submit.

The cluster is the one of ``make test-cluster``: each host a network namespace with its own
address and disk, set up by docs/cluster.md's commands (PostgreSQL and SeaweedFS on ``db``, two
schedulers, haproxy with ``deploy/haproxy.cfg`` on ``lb``, two trainers). A PPO task runs
throughout. Each round kills the leader's scheduler with SIGKILL; two clients on ``lb``, one
through haproxy and one with the URL list of both schedulers, submit until a submit is
acknowledged; both are asked right after one kill, which times both paths. The killed
scheduler starts again and becomes the follower before the next round.

Needs root, ip, nsenter, unshare, haproxy and PostgreSQL 15 (``make test-deps`` installs them).
Run with ``make bench-cluster``; the result goes to ``benchmarks/results/cluster-failover.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "scripts")]

from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)

from tests.cluster.harness import SCHEDULERS, Cluster, ppo  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

URL_LIST = ",".join(f"http://{s}:8888" for s in SCHEDULERS)


def one_round(cluster: Cluster, probes: dict) -> dict[str, float]:
    """Kill the leader; seconds from the kill to each client's first acknowledged submit."""
    leader = wait_for(cluster.leader, timeout=120, what="one leader")
    # A submit now is acknowledged at once: each client's leader is known before the kill.
    for name, probe in probes.items():
        assert cluster.call("leader_call", probe=probe, hyperparameters=ppo(1)), name
    killed_at = time.time()
    cluster.stop_service(leader, "scheduler")  # SIGKILL to its process group
    for probe in probes.values():  # the clients start submitting now, a few ms apart
        cluster.send("leader_call", probe=probe, hyperparameters=ppo(1))
    out = {}
    for name, probe in probes.items():
        at = cluster.answer("leader_call", probe=probe)
        assert at is not None, f"{name}: no acknowledged submit"
        out[name] = at - killed_at
    cluster.start_service(leader, "scheduler")
    ready = "curl -sS --retry 60 --retry-connrefused --retry-delay 1 -o /dev/null http://localhost:8889/health"
    cluster.hosts.run(leader, ready)
    cluster.wait_trainers()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="leader kills (default 3)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench-cluster needs root: simulated hosts are network and mount namespaces", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {"haproxy": [], "urls": []}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.set_up()
            probes = {"haproxy": cluster.probe, "urls": cluster.open_probe(URL_LIST)}
            task_id = cluster.call("submit", hyperparameters=ppo(100_000, checkpoint_every=50))
            cluster.running(task_id, checkpoint_step=1)
            for r in range(args.rounds):
                got = one_round(cluster, probes)
                for k, v in got.items():
                    times[k].append(v)
                print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in got.items()), flush=True)
            task = cluster.task(task_id)
            assert task.get("attempt") == 1, f"the running task kept its attempt across the kills: {task}"
            probes["urls"].stdin.close()
            probes["urls"].kill()
        finally:
            cluster.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"failover, median of {args.rounds}: haproxy {medians['haproxy']:.2f} s, URL list {medians['urls']:.2f} s")
    write_result(
        "cluster-failover",
        what="Failover across simulated hosts: kill -9 of the leader to the first acknowledged SubmitTask, median",
        peer="the leader lease alone; goal from the issue",
        ratios=[
            {"label": "through the URL list", "value": medians["urls"], "unit": " s"},
            {"label": "through haproxy with deploy/haproxy.cfg", "value": medians["haproxy"], "unit": " s"},
        ],
        make="make bench-cluster",
        goal="<= 3 s",
        settings={"rounds": args.rounds, "hosts": "docs/cluster.md: db, scheduler-a, scheduler-b, lb, trainer-1, -2"},
        notes="Network namespaces with their own addresses and disks, set up by docs/cluster.md's commands; "
        "a PPO task runs throughout and keeps its attempt.",
        details={"seconds": times},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
