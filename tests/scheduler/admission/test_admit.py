"""admit(): the submit pipeline's stages run in order (limits, local paths, references, the
environment, the core's own checks) and the first refusal wins; nothing is written on a refusal.
A real core, store, dataset folder and limiter; no gRPC."""

from __future__ import annotations

import asyncio

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.admission.admit import admit
from opentinker_scheduler.config.limits import LimitsConfig
from opentinker_scheduler.config.paths import PathsConfig
from opentinker_scheduler.data.datasets import DatasetStore
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from opentinker_scheduler.security.keys import Principal
from opentinker_scheduler.security.limits import Limits

from tests.scheduler.state.test_core import make_core, spec

ALICE = Principal("alice", "user", key_prefix="otk_0000aaaa")
MISSING_DATASET = "sha256:" + "0" * 64


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env(tmp_path):
    core = make_core(tmp_path, paths=PathsConfig(model_dirs=("/models",)))
    datasets = DatasetStore(tmp_path / "datasets")
    yield core, datasets
    core.store.close()


def run(core, datasets, s: C.TaskSpec, *, limits: Limits | None = None, request_id: str = ""):
    return asyncio.run(admit(s, ALICE, core=core, datasets=datasets, limits=limits, request_id=request_id))


def pending(core) -> int:
    return core.store.count_tasks(owner="alice", states=(C.TASK_STATE_PENDING,))


def bad_path() -> C.TaskSpec:
    return spec(model="/private/m")  # outside paths.model_dirs: a stage-2 refusal


def test_limits_come_first_rate_then_size_then_pending(env) -> None:
    core, datasets = env
    clock = Clock()
    limits = Limits(
        LimitsConfig(submit_rate=1, submit_burst=1, max_spec_bytes=1024, max_pending_per_owner=1).resolved(
            auth_enabled=True
        ),
        clock=clock,
    )
    with pytest.raises(InvalidArgument, match="spec.model"):  # the token is taken, then paths refuse
        run(core, datasets, bad_path(), limits=limits)
    with pytest.raises(ResourceExhausted, match="limits.submit_rate"):  # no token left: before paths
        run(core, datasets, bad_path(), limits=limits)
    clock.now += 10
    big = bad_path()
    big.name = "x" * 2000
    with pytest.raises(ResourceExhausted, match="limits.max_spec_bytes"):  # size before paths
        run(core, datasets, big, limits=limits)
    clock.now += 10
    run(core, datasets, spec(), limits=limits)
    clock.now += 10
    with pytest.raises(ResourceExhausted, match="limits.max_pending_per_owner"):  # pending before paths
        run(core, datasets, bad_path(), limits=limits)
    assert pending(core) == 1


def test_local_paths_come_before_references(env) -> None:
    core, datasets = env
    s = bad_path()
    s.env_config.update({"dataset_id": MISSING_DATASET})
    with pytest.raises(InvalidArgument, match="spec.model"):
        run(core, datasets, s)
    s.model = "/models/m"
    with pytest.raises(NotFound, match="spec.env_config.dataset_id"):
        run(core, datasets, s)


def test_references_come_before_the_environment_check(env) -> None:
    core, datasets = env
    s = spec()
    s.env_config.update({"env_id": "no-such-env", "dataset_id": MISSING_DATASET})
    with pytest.raises(NotFound, match="spec.env_config.dataset_id"):
        run(core, datasets, s)
    s = spec()
    s.env_config.update({"env_id": "no-such-env"})
    s.init_from = "task-nope"
    with pytest.raises(NotFound, match="spec.init_from"):
        run(core, datasets, s)


def test_the_environment_check_comes_before_the_cores_checks(env) -> None:
    core, datasets = env
    s = spec(gpus=100)
    s.env_config.update({"env_id": "no-such-env"})
    with pytest.raises(InvalidArgument, match="spec.env_config.env_id"):
        run(core, datasets, s, request_id="r" * 200)  # the core would refuse request_id first
    with pytest.raises(InvalidArgument, match="request_id"):
        run(core, datasets, spec(gpus=100), request_id="r" * 200)
    with pytest.raises(FailedPrecondition, match="spec.resources.gpu_count"):
        run(core, datasets, spec(gpus=100))
    assert pending(core) == 0


def test_an_admitted_spec_is_one_pending_task_of_the_caller(env) -> None:
    core, datasets = env
    task = run(core, datasets, spec(), request_id="once")
    assert (task.state, task.owner, task.attempt) == (C.TASK_STATE_PENDING, "alice", 1)
    again = run(core, datasets, spec(), request_id="once")  # same request id and spec: the same task
    assert again.task_id == task.task_id and pending(core) == 1


def test_a_quota_queue_sets_the_per_owner_limits_of_its_owners(tmp_path) -> None:
    from opentinker_scheduler.config import QueueConfig

    queue = QueueConfig("team-a", gpus=4, owners=("alice",), max_pending_per_owner=1, submit_rate=1, submit_burst=2)
    core = make_core(tmp_path, paths=PathsConfig(model_dirs=("/models",)), queues=(queue,))
    datasets = DatasetStore(tmp_path / "datasets")
    clock = Clock()
    limits = Limits(LimitsConfig(submit_rate=100, max_pending_per_owner=100).resolved(auth_enabled=True), clock=clock)
    run(core, datasets, spec(), limits=limits)
    with pytest.raises(ResourceExhausted, match=r"the limit is 1 \(queues\[0\]\.limits\.max_pending_per_owner\)"):
        run(core, datasets, spec(), limits=limits)
    with pytest.raises(
        ResourceExhausted, match=r"at most 1 SubmitTask .*burst 2\) \(queues\[0\]\.limits\.submit_rate\)"
    ):
        run(core, datasets, spec(), limits=limits)  # the queue's burst of 2 is used up
    assert pending(core) == 1
    core.store.close()


def test_a_submit_waiting_for_its_group_commit_counts_towards_max_pending_per_owner(env) -> None:
    from opentinker_scheduler.admission.admit import check_limits

    core, _ = env
    limits = Limits(LimitsConfig(submit_rate=100, max_pending_per_owner=1).resolved(auth_enabled=True), clock=Clock())

    async def main() -> None:
        core.enable_group_commit()
        waiting = asyncio.ensure_future(core.api.submit_grouped(spec(), owner="alice"))
        await asyncio.sleep(0)  # validated, its row waits for the group commit
        assert pending(core) == 0 and not waiting.done()
        with pytest.raises(ResourceExhausted, match="already has 1 PENDING task"):
            check_limits(limits, spec(), ALICE, core=core)
        await waiting
        await core.durable()
        assert pending(core) == 1

    asyncio.run(main())
