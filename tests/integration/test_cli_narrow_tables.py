"""``opentinker keys list``, ``queues`` and ``usage`` on an 80-column terminal against a real
scheduler: every line fits, and no key prefix, owner, queue name or figure is cut, folded or
lost (columns that do not fit go on a line under their row, as ``list`` and ``nodes`` do)."""

from __future__ import annotations

import os

from opentinker_client import RLClient

from tests.support.security import LoopbackScheduler
from tests.support.tty import run_on_tty

CONFIG = """auth: {enabled: true}
resource_pool:
  - {node_id: gpu-node-01, gpu_count: 4, max_tasks: 8}
queues:
  - name: research-team-with-a-long-name
    gpus: 8
    cpu_tasks: 16
    borrowing_limit: {gpus: 4}
    owners: [alice-the-researcher, bob-from-the-platform-team]
    limits: {max_pending_per_owner: 200, submit_rate: 5, submit_burst: 20}
  - name: team-b
    gpus: 4
    cpu_tasks: 4
    owners: [carol]
"""


def test_keys_queues_and_usage_fit_80_columns_with_every_value_whole(tmp_path) -> None:
    with LoopbackScheduler(tmp_path / "state", CONFIG) as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            alice, _ = root.keys.create(
                "alice-the-researcher", "user", description="the laptop in the lab, rotated every month by the ops team"
            )
            carol, carol_key = root.keys.create("carol", "user")
        with RLClient(s.target, api_key=carol_key) as c:
            c.submit_task(workload_type="lora_finetune", model="org/m", gpu_count=1)
        env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
        base = ["--scheduler-url", s.target, "--api-key", s.admin_key]
        wanted = {
            ("keys", "list"): [alice.prefix, carol.prefix, "alice-the-researcher", "rotated every month", "ops team"],
            ("queues",): ["research-team-with-a-long-name", "alice-the-researcher", "bob-from-the-platform-team",
                          "team-b", "200 pending", "5/s burst 20", "0/8", "0/16", "10/s burst 50"],
            ("usage",): ["OWNER", "QUEUE", "GPU-HOURS", "COST (USD)"],  # nothing ran yet: the tables are empty
        }  # fmt: skip
        for args, values in wanted.items():
            for columns in (200, 80):
                rc, out = run_on_tty([*base, *args], env={**env, "COLUMNS": str(columns)})
                assert rc == 0, out
                lines = out.splitlines()
                assert all(len(line.rstrip()) <= columns for line in lines), f"{args} at {columns}:\n{out}"
                for value in values:
                    assert any(value in line for line in lines), f"{value!r}, {args} at {columns} columns:\n{out}"
                assert "…" not in out, out
