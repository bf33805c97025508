"""Client-hosted environments through real scheduler and trainer processes: the environment
lives in this test process, RLClient serves it, the trainer's worker calls it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from opentinker_client import Environment, RLClient, TaskFailedError

from tests.support.waiting import wait_for, wait_progress

HP = {"steps": 2, "episodes_per_step": 2, "max_turns": 3, "max_new_tokens": 3, "lora_rank": 4}


class Corridor(Environment):
    """Four squares; 'right' moves right, 'left' left; the far end pays 1."""

    resets: list = []  # class-level: the served instances are copies of the submitted object

    def __init__(self, **options):
        super().__init__(action_space=2, observation_space=4, action_names=["left", "right"], **options)
        self.pos = 0

    def reset(self, seed=None):
        type(self).resets.append(seed)
        self.pos = 0
        return self.pos

    def step(self, action):
        self.pos = max(0, min(3, self.pos + (1 if action == 1 else -1)))
        return self.pos, float(self.pos == 3), self.pos == 3, False, {}


class Exploding(Corridor):
    def reset(self, seed=None):
        raise RuntimeError("reactor core breach in reset")


class Stalling(Corridor):
    def reset(self, seed=None):
        time.sleep(3)
        return 0


def submit(client: RLClient, env_config, model_dir: Path, **options) -> str:
    """A lora_finetune task of the tiny model on ``env_config`` (``HP`` unless ``hyperparameters``)."""
    options.setdefault("hyperparameters", HP)
    return client.submit_task(env_config=env_config, workload_type="lora_finetune", model=str(model_dir), **options)


def test_client_hosted_environment_trains_to_success(cluster, tiny_model_dir: Path) -> None:
    cluster.start_with_trainer()
    Corridor.resets = []
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        with client.serve_environment(Corridor()) as server:
            assert server.env_config["endpoint"].startswith("127.0.0.1:")
            task_id = submit(client, server.env_config, tiny_model_dir)
            task = cluster.wait_done(client, task_id)
            assert task.state == "succeeded"
            history = client.get_metric_history(task_id)
            assert [s for s, _ in history] == [1, 2]
            assert all({"reward", "loss", "episode/turns"} <= set(v) for _, v in history)
            assert len(Corridor.resets) >= 2 * HP["episodes_per_step"]  # the trainer played in this process
            assert server.servicer.session_count() == 0  # the worker closed its session at the end
        assert server.stopped


def test_submit_task_serves_the_environment_for_the_tasks_lifetime(cluster, tiny_model_dir: Path) -> None:
    cluster.start_with_trainer()
    Corridor.resets = []
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = submit(client, Corridor(), tiny_model_dir, hyperparameters={**HP, "steps": 1})
        (server,) = client._env_servers
        assert client.get_task(task_id).env_config["env_id"] == "client"
        assert cluster.wait_done(client, task_id).state == "succeeded"
        wait_for(lambda: server.stopped, timeout=60, what="the environment server stops by itself once the task ended")
        assert Corridor.resets


def test_environment_that_raises_fails_the_task_with_its_message(cluster, tiny_model_dir: Path) -> None:
    cluster.start_with_trainer()
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = submit(client, Exploding(), tiny_model_dir)
        with pytest.raises(TaskFailedError) as err:
            cluster.wait_done(client, task_id)
    task = err.value.task
    assert task.state == "failed" and task.attempt == 1  # not retried: a retry cannot fix it
    assert "Exploding.reset raised RuntimeError: reactor core breach in reset" in task.error


def test_environment_that_does_not_answer_fails_naming_the_timeout(cluster, tiny_model_dir: Path) -> None:
    cluster.start_with_trainer()
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = submit(client, Stalling(timeout_s=0.5), tiny_model_dir)
        with pytest.raises(TaskFailedError) as err:
            cluster.wait_done(client, task_id)
    assert "did not answer reset within timeout_s=0.5 s" in err.value.task.error


def test_client_that_goes_away_fails_the_task_after_the_grace_period(cluster, tiny_model_dir: Path) -> None:
    cluster.start_with_trainer()
    playing = threading.Event()

    class Watched(Corridor):
        def reset(self, seed=None):
            playing.set()
            return super().reset(seed)

    client = RLClient(scheduler_url=cluster.url, min_poll_interval=0)
    # Many steps, so the task is surely still running when the client leaves.
    task_id = submit(
        client, Watched(grace_s=2), tiny_model_dir, hyperparameters={**HP, "steps": 10_000}, max_attempts=1
    )
    wait_progress(playing.is_set, lambda: cluster.said_about(task_id), what="the trainer resets the environment")
    client.close()  # stops the environment server; the task must not hang
    task = cluster.wait_state(task_id, 5)  # FAILED
    assert "unreachable for grace_s=2 s" in task.error and "Watched" in task.error


def test_client_hosted_environment_over_tls_with_an_access_token(cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    """submit_task serves the environment on TLS with a token; the trainer (another process)
    trusts the CA from the spec, sends the token, and the task succeeds. The token appears in
    no log of the scheduler, the trainer or its worker."""
    from tests.support.security import make_certs

    certs = make_certs(tmp_path / "certs")
    cluster.start_with_trainer()
    Corridor.resets = []
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = submit(
            client,
            Corridor(),
            tiny_model_dir,
            hyperparameters={**HP, "steps": 1},
            env_tls_cert=certs.server_cert,
            env_tls_key=certs.server_key,
            env_tls_ca=certs.ca,
        )
        (server,) = client._env_servers
        env = client.get_task(task_id).env_config
        assert (
            env["tls"] is True and env["token"] == server.token and "BEGIN CERTIFICATE" in env["tls_root_certificates"]
        )
        assert cluster.wait_done(client, task_id).state == "succeeded"
        assert Corridor.resets  # the trainer played over TLS
        assert server.auth.refused == 0
    logs = "".join(p.log_text() for p in cluster.procs)  # scheduler, trainer and (inherited stderr) worker
    assert "opentinker.worker" in logs or "worker" in logs
    assert server.token not in logs


def test_wrong_access_token_fails_the_task_at_once_naming_the_cause(cluster, tiny_model_dir: Path) -> None:
    cluster.start_with_trainer()
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        with client.serve_environment(Corridor(grace_s=120)) as server:
            env_config = {**server.env_config, "token": "not-the-servers-token-0123456789"}
            task_id = submit(client, env_config, tiny_model_dir)
            with pytest.raises(TaskFailedError) as err:
                cluster.wait_done(client, task_id)
    task = err.value.task
    assert task.state == "failed" and task.attempt == 1  # not retried, and grace_s=120 not waited for
    assert (
        f"the access token (env_config.token) did not match the environment server at {server.endpoint}" in task.error
    )
    assert server.token not in task.error and "not-the-servers-token" not in task.error
