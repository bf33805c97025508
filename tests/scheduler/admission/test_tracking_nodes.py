"""A task naming a ``spec.tracking`` logger that no connected trainer node can write is refused at
submit (FAILED_PRECONDITION naming the field and the extra), against a real scheduler with auth on;
nodes are registered on the scheduler's loop with what they say they can write (no trainer
process; what a trainer reports: ``tests/trainer/test_tracking_loggers.py``)."""

from __future__ import annotations

import pytest

from opentinker.node.v1 import node_pb2 as N
from opentinker_client import FailedPreconditionError, RLClient

from tests.support.security import LoopbackScheduler

TRACKING_DIR = "/tmp/opentinker-tracking-test"


def test_a_logger_no_connected_node_can_write_is_refused_at_submit(tmp_path) -> None:
    config = f"auth: {{enabled: true}}\npaths: {{tracking_dirs: [{TRACKING_DIR}]}}\n"
    with LoopbackScheduler(tmp_path / "state", config) as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            _, key = root.keys.create("alice", "user")
        spec = dict(workload_type="full_rl", model="mlp", env_config={"env_id": "CartPole-v1"})
        mlflow = {"mlflow": {"uri": f"file://{TRACKING_DIR}/mlruns"}}
        with RLClient(s.target, api_key=key) as alice:
            alice.cancel(alice.submit_task(**spec, tracking=mlflow))  # no node yet: it may wait for one
            reg = N.Register(node_id="cpu-1", max_tasks=2, tracking_loggers=["tensorboard"], tracking_reported=True)
            s.do(s.core.node_register, reg)
            with pytest.raises(FailedPreconditionError) as info:
                alice.submit_task(**spec, tracking={"tensorboard": f"{TRACKING_DIR}/tb", **mlflow}, name="refused")
            assert info.value.details == (
                "spec.tracking.mlflow: no connected trainer node can write mlflow runs (the mlflow package is not "
                "installed on cpu-1); install it on the trainer nodes with pip install 'opentinker[mlflow]', or "
                "drop tracking.mlflow from the spec"
            )
            assert not [t for t in alice.list_tasks() if t.name == "refused"]  # nothing stored
            alice.cancel(alice.submit_task(**spec, tracking={"tensorboard": f"{TRACKING_DIR}/tb"}))
            # A node agent that predates the field says nothing: nothing is refused on its account.
            s.do(s.core.node_register, N.Register(node_id="old-agent", max_tasks=2))
            alice.cancel(alice.submit_task(**spec, tracking=mlflow))
