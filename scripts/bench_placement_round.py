"""What a placement round costs the scheduler core with a deep queue and quota queues at quota
(``make bench-placement-round``).

In-process, no gRPC: a :class:`~opentinker_scheduler.state.core.SchedulerCore` on SQLite with
``--nodes`` registered nodes (2 GPUs, ``max_tasks`` 4; LoRA tasks on one base model may share a
GPU, two per GPU), ``--queues`` quota queues splitting the cluster's GPUs and CPU-task slots
between ``--owners`` owners (as ``bench_scheduler.py --queues --owners`` configures them), or,
with ``--queues 0``, every owner a queue of its own with no quota. One-GPU tasks are submitted in
owner order and placed until the quotas (or, without quotas, the nodes) are full, then
``--pending`` more wait. Measured: ``--rounds`` times, one more submit and the placement round
that follows it (what every ``SubmitTask`` does), as scheduler CPU per submit+round
(``time.process_time``) and, for the round alone, CPU per ``schedule()`` call. With quotas at
quota and GPU room left on the nodes (GPU sharing), every round asks the quota of every queue's
group; without quotas nothing fits and the round ends at once.

``--tree DIR`` imports ``opentinker_scheduler`` from DIR instead (a ``git archive`` of another
commit), to compare versions on the same machine in the same minute. Figures are printed, never
asserted. Example::

    python scripts/bench_placement_round.py --queues 20 --owners 100 --nodes 100 --pending 600
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queues", type=int, default=20)
    p.add_argument("--owners", type=int, default=100)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--pending", type=int, default=600, help="tasks waiting behind the full quotas")
    p.add_argument("--rounds", type=int, default=500, help="measured submits, each with its placement round")
    p.add_argument("--tree", default=None, help="import opentinker_scheduler from this folder")
    a = p.parse_args(argv)
    sys.path[:0] = [*([a.tree] if a.tree else []), str(REPO), str(REPO / "protos")]
    out, sys.stderr = sys.stderr, open(os.devnull, "w")  # the core's log lines go nowhere
    from opentinker_common.logs import configure_logging

    configure_logging(json=True)
    from opentinker.common.v1 import common_pb2 as C
    from opentinker.node.v1 import node_pb2 as N

    import opentinker_scheduler
    from opentinker_scheduler.config import PoolNode, QueueConfig, SchedulerConfig
    from opentinker_scheduler.state.core import SchedulerCore
    from opentinker_scheduler.state.store import SqliteStore

    tmp = Path(tempfile.mkdtemp(prefix="opentinker-bench-round-"))
    gpus, slots = 2, 4
    queues = ()
    if a.queues:
        per_q = (max(1, a.nodes * gpus // a.queues), max(1, a.nodes * slots // a.queues))
        queues = tuple(
            QueueConfig(
                f"queue-{q:02d}",
                gpus=per_q[0],
                cpu_tasks=per_q[1],
                owners=tuple(f"owner-{o:03d}" for o in range(q, a.owners, a.queues)),
            )
            for q in range(a.queues)
        )
    cfg = SchedulerConfig(resource_pool=(PoolNode("node-0000", gpus, slots),), state_dir=tmp, queues=queues)
    core = SchedulerCore(cfg, SqliteStore(tmp))
    for i in range(a.nodes):
        devices = [C.Device(index=d, uuid=f"u{i}-{d}", name="g", simulated=True) for d in range(gpus)]
        core.node_register(N.Register(node_id=f"node-{i:04d}", devices=devices, max_tasks=slots))
    serial = iter(range(1 << 62))

    def submit() -> None:
        i = next(serial)
        spec = C.TaskSpec(workload_type="lora_finetune", model="bench/dummy-model", resources=C.Resources(gpu_count=1))
        spec.env_config.update({"env_id": "arithmetic"})
        core.api.submit(spec, owner=f"owner-{i % a.owners:03d}")

    # Fill: place what the quotas (or nodes) take, then let --pending wait behind them.
    while True:
        submit()
        if not core.schedule():
            break
    for _ in range(a.pending):
        submit()
    core.schedule()
    running, waiting = len(core.active), len(core.queue)
    for _ in range(20):  # warm up
        submit()
        core.schedule()
    t0 = time.process_time()
    for _ in range(a.rounds):
        submit()
    submit_s = time.process_time() - t0
    t0 = time.process_time()
    for _ in range(a.rounds):
        core.schedule()
    round_s = time.process_time() - t0
    t0 = time.process_time()
    for _ in range(a.rounds):
        submit()
        core.schedule()
    both_s = time.process_time() - t0
    where = Path(opentinker_scheduler.__file__).parent.parent
    print(
        f"placement round, {a.queues or 'no'} quota queues, {a.owners} owners, {a.nodes} nodes: {running} running, "
        f"{waiting} pending ({where}):\n"
        f"  submit + round: {both_s / a.rounds * 1000:.3f} ms CPU; round alone: {round_s / a.rounds * 1000:.3f} ms; "
        f"submit alone: {submit_s / a.rounds * 1000:.3f} ms",
        file=out,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
