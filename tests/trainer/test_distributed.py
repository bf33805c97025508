"""The rank plan of an assignment, and the shares of a batch each rank takes."""

from __future__ import annotations

import contextlib
import os

import pytest

from opentinker.node.v1 import node_pb2
from opentinker_trainer.context import UserError
from opentinker_trainer.distributed import RankPlan, per_rank_count, plan_for, shard

from tests.support.distributed import task_spec

GRPO = task_spec(workload_type="lora_finetune", model="m", env_config={"env_id": "arithmetic"}, hyperparameters={})
SERVE = task_spec(workload_type="inference", model="m", env_config={"env_id": "arithmetic"}, hyperparameters={})


@pytest.mark.parametrize("n,w", [(5, 2), (6, 3), (1, 1), (7, 4), (2, 4)])
def test_shards_cover_the_items_once_in_order(n, w) -> None:
    parts = [shard(n, r, w) for r in range(w)]
    assert [i for p in parts for i in p] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_one_device_or_a_serving_task_is_one_rank() -> None:
    assert plan_for(node_pb2.AssignTask(spec=GRPO, device_indices=[3]), "cuda") is None
    assert plan_for(node_pb2.AssignTask(spec=GRPO), "cpu") is None
    assert plan_for(node_pb2.AssignTask(spec=SERVE, device_indices=[0, 1]), "cuda") is None


def test_several_devices_are_as_many_ranks_on_this_node() -> None:
    plan = plan_for(node_pb2.AssignTask(spec=GRPO, device_indices=[2, 5]), "cpu")
    assert plan == RankPlan(world_size=2, rank_offset=0, local_world_size=2, cuda=False)
    assert plan.backend == "gloo" and plan.device(1) == "cpu"
    cuda = plan_for(node_pb2.AssignTask(spec=GRPO, device_indices=[2, 5]), "cuda")
    assert cuda.backend == "nccl" and cuda.device(1) == "cuda:1"


def test_a_gang_member_follows_its_assignment() -> None:
    gang = node_pb2.GangMember(
        world_size=4,
        rank_offset=2,
        local_world_size=2,
        member_index=1,
        members=2,
        rendezvous_host="10.0.0.1",
        rendezvous_port=29500,
    )
    plan = plan_for(node_pb2.AssignTask(spec=GRPO, device_indices=[0, 1], gang=gang), "cpu")
    assert (plan.world_size, plan.rank_offset, plan.local_world_size) == (4, 2, 2)
    assert (plan.rendezvous_host, plan.rendezvous_port, plan.member_index) == ("10.0.0.1", 29500, 1)
    with pytest.raises(UserError, match="spec.resources.nodes 2"):
        plan_for(node_pb2.AssignTask(spec=SERVE, device_indices=[0, 1], gang=gang), "cpu")


def test_an_uneven_share_of_vector_envs_is_refused_with_the_field() -> None:
    class DP:
        world_size = 2

    assert per_rank_count(8, None, "hyperparameters.num_envs") == 8
    assert per_rank_count(8, DP(), "hyperparameters.num_envs") == 4
    with pytest.raises(UserError, match="hyperparameters.num_envs 3: must be a multiple of the task's world size 2"):
        per_rank_count(3, DP(), "hyperparameters.num_envs")


def test_the_trainers_that_run_distributed_are_those_the_spec_lets_span_nodes() -> None:
    from opentinker_common.spec.task import GANG_WORKLOADS
    from opentinker_trainer.distributed import DISTRIBUTED_TRAINERS

    assert DISTRIBUTED_TRAINERS == GANG_WORKLOADS


def _sleeper() -> None:
    import time

    time.sleep(60)


def test_a_rank_killed_by_a_signal_is_named_even_when_another_thread_reaped_it() -> None:
    """The watchdog thread may ``waitpid`` a dead rank first; the launcher's own look then sees
    no status (the ``Process`` says its exit code is None), and must take the watchdog's record
    instead of reporting the surviving rank's broken collective."""
    import multiprocessing
    import signal

    from opentinker_trainer.distributed import _lost_rank

    plan = plan_for(node_pb2.AssignTask(spec=GRPO, device_indices=[0, 1]), "cpu")
    p = multiprocessing.get_context("spawn").Process(target=_sleeper)
    p.start()
    try:
        os.kill(p.pid, signal.SIGKILL)
        _, status = os.waitpid(p.pid, 0)  # reaped behind the Process's back, as by another thread
        assert p.exitcode is None
        assert _lost_rank([p], plan, {}, wait_s=0.2) is None  # nothing known: no rank named
        code = os.waitstatus_to_exitcode(status)
        assert _lost_rank([p], plan, {1: code}, wait_s=0.2) == f"rank 1 (pid {p.pid}) killed by signal 9"
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(p.pid, signal.SIGKILL)
            os.waitpid(p.pid, 0)


def test_a_rank_that_exited_with_a_code_is_not_named_as_lost() -> None:
    import multiprocessing

    from opentinker_trainer.distributed import _lost_rank

    plan = plan_for(node_pb2.AssignTask(spec=GRPO, device_indices=[0, 1]), "cpu")
    p = multiprocessing.get_context("spawn").Process(target=os._exit, args=(3,))
    p.start()
    p.join()
    assert p.exitcode == 3
    assert _lost_rank([p], plan, {}, wait_s=5.0) is None  # returns at once: every end is known
