"""Real scheduler and trainer processes: health, reflection via real grpcurl, bad input codes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S

from tests.support.procs import scheduler_args

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30)


def test_health_reflection_and_grpcurl(cluster) -> None:
    cluster.start_scheduler()
    assert cluster.health() == {"status": "ok"}
    listed = grpcurl(f"127.0.0.1:{cluster.port}", "list")
    assert listed.returncode == 0, listed.stderr
    for name in ("opentinker.scheduler.v1.SchedulerService", "opentinker.node.v1.NodeService", "grpc.health.v1.Health"):
        assert name in listed.stdout
    described = grpcurl(f"127.0.0.1:{cluster.port}", "describe", "opentinker.scheduler.v1.SchedulerService")
    assert "rpc WatchTask" in described.stdout and "stream" in described.stdout
    health = grpcurl(f"127.0.0.1:{cluster.port}", "grpc.health.v1.Health/Check")
    assert '"SERVING"' in health.stdout
    submitted = grpcurl(
        "-d",
        '{"spec": {"workload_type": "lora_finetune", "model": "/models/x", "resources": {"gpu_count": 0}}}',
        f"127.0.0.1:{cluster.port}",
        "opentinker.scheduler.v1.SchedulerService/SubmitTask",
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "TASK_STATE_PENDING" in submitted.stdout and "no trainer node is connected" in submitted.stdout


@pytest.mark.parametrize(
    ("spec", "code", "needle"),
    [
        (
            C.TaskSpec(workload_type="rlhf", model="m"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "spec.workload_type: expected one of lora_finetune, full_rl",
        ),
        (
            C.TaskSpec(workload_type="lora_finetune", model="m", resources=C.Resources(gpu_count=-2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "spec.resources.gpu_count",
        ),
        (
            C.TaskSpec(workload_type="lora_finetune", model="m", resources=C.Resources(gpu_count=64)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "64 GPU(s) asked",
        ),
    ],
)
def test_bad_specs_get_clear_status(cluster, spec, code, needle) -> None:
    cluster.start_scheduler()
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.SubmitTask(S.SubmitTaskRequest(spec=spec))
    assert err.value.code() == code
    assert needle in err.value.details()
    assert list(cluster.stub.ListTasks(S.ListTasksRequest()).tasks) == []


def test_unknown_env_and_missing_task(cluster) -> None:
    cluster.start_scheduler()
    spec = C.TaskSpec(workload_type="lora_finetune", model="m")
    spec.env_config.update({"env_id": "chess-9000"})
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.SubmitTask(S.SubmitTaskRequest(spec=spec))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.env_config.env_id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.GetTask(S.GetTaskRequest(task_id="task-000000000000"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        cluster.stub.ListTasks(S.ListTasksRequest(page_token="garbage!"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cpu_node_registers_and_says_so(cluster) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("cpu-node")
    (node,) = cluster.wait_nodes(1)
    assert node.node_id == "cpu-node" and node.gpu_count == 0
    assert any("CPU only" in n for n in node.notes)
    cluster.start_trainer("sim-node", "--simulate-gpus", "2")
    nodes = {n.node_id: n for n in cluster.wait_nodes(2)}
    sim = nodes["sim-node"]
    assert sim.gpu_count == 2 and all(d.simulated for d in sim.devices)
    assert any("SIMULATED" in n for n in sim.notes)


def test_bad_scheduler_config_refused_at_start(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("resource_pool:\n  - node_id: a\n    gpus: 4\n")
    out = subprocess.run(
        [sys.executable, "-m", "opentinker_scheduler", "--config", str(cfg), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"{cfg}:3:5: resource_pool[0].gpus" in out.stderr


def second_scheduler(cluster, *, port: int, state_dir: Path) -> subprocess.CompletedProcess:
    """Another scheduler process with ``cluster``'s config (default host, any HTTP port), run to its end."""
    args = scheduler_args(cluster.config_path, port=port, http_port=0, state_dir=state_dir)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)


def test_second_scheduler_on_same_port_or_state_dir_refused(cluster) -> None:
    cluster.start_scheduler()
    same_port = second_scheduler(cluster, port=cluster.port, state_dir=cluster.tmp / "other")
    assert same_port.returncode == 1 and f"cannot listen on gRPC port 0.0.0.0:{cluster.port}" in same_port.stderr
    assert "Traceback" not in same_port.stderr
    same_state = second_scheduler(cluster, port=0, state_dir=cluster.state_dir)
    assert same_state.returncode == 1 and "is in use by another scheduler" in same_state.stderr
    assert cluster.health() == {"status": "ok"}


def test_duplicate_trainer_node_id_is_refused(cluster) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("twin")
    cluster.wait_nodes(1)
    second = cluster.start_trainer("twin", url=cluster.url)
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "already connected" not in second.log_text():
        time.sleep(0.2)
    assert "already connected" in second.log_text()
    nodes = cluster.wait_nodes(1)
    assert [n.node_id for n in nodes] == ["twin"]
