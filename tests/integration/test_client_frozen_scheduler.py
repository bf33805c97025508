"""The client against a real scheduler frozen with SIGSTOP (resumed with SIGCONT in a finally):
watch, get_task and wait end within their timeouts (+10 s), and the watch resumes once the
scheduler does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import opentinker_client as ot
from opentinker_client import RLClient
from tests.support.frozen import raises_within

TINY_HP = {"steps": 3, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}
SLACK = 10.0

pytestmark = pytest.mark.timeout(300)


def test_client_calls_end_within_their_timeouts_against_a_stopped_scheduler(tmp_path) -> None:
    from tests.support.procs import Cluster

    cluster = Cluster(tmp_path)
    try:
        cluster.start_scheduler()
        with RLClient(scheduler_url=cluster.url, api_key="", min_poll_interval=0) as client:
            # No trainer: the task stays PENDING, its watch quiet after the first events.
            task_id = client.submit_task(workload_type="lora_finetune", model="/m", hyperparameters=TINY_HP)
            first = next(iter(client.watch(task_id, follow=False)))
            os.kill(cluster.scheduler.pid, signal.SIGSTOP)
            try:
                with RLClient(scheduler_url=cluster.url, api_key="", timeout=30, min_poll_interval=0) as fresh:
                    fresh.reconnect_backoff = (0.05, 0.5)
                    exc = raises_within(lambda: list(fresh.watch(task_id, reconnect_timeout=2)), 2 + SLACK)
                    assert isinstance(exc, ot.UnavailableError), exc
                    exc = raises_within(
                        lambda: list(fresh.watch(task_id, reconnect_timeout=None, timeout=2)), 2 + SLACK
                    )
                    assert isinstance(exc, ot.DeadlineExceededError), exc
                client.timeout = 1
                exc = raises_within(lambda: client.get_task(task_id), 1 + SLACK)
                assert isinstance(exc, ot.DeadlineExceededError), exc
                assert str(exc).startswith(f"DEADLINE_EXCEEDED: the scheduler at {cluster.url.split('//')[-1]} did ")
                exc = raises_within(lambda: client.wait(task_id, timeout=1, poll_interval=0.2), 1 + SLACK)
                assert isinstance(exc, ot.DeadlineExceededError), exc
                # `opentinker list` says early that it is waiting (stderr), then why it gave up.
                env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
                cmd = [sys.executable, "-m", "opentinker_client", "--scheduler-url", cluster.url, "list"]
                listed = subprocess.run([*cmd, "--timeout", "4"], capture_output=True, text=True, env=env, timeout=60)
                address = cluster.url.split("//")[-1]
                assert listed.returncode == 2 and listed.stdout == "", listed
                waiting, error = listed.stderr.strip().splitlines()
                assert waiting.startswith(f"the scheduler at {address} has not answered ListTasks in 3 s; still wait")
                assert error.startswith(f"error: the scheduler at {address} did not answer ListTasks within 4 s")
                assert error.endswith("[DEADLINE_EXCEEDED]")
                # With localhost and a timeout longer than gRPC's connection handshake (20 s), gRPC
                # gives up first and names the last address it tried (::1, refusing): still the
                # scheduler is there and silent, and the error says so.
                port = address.rpartition(":")[2]
                local = [sys.executable, "-m", "opentinker_client", "--scheduler-url", f"localhost:{port}", "list"]
                listed = subprocess.run(local, capture_output=True, text=True, env=env, timeout=120)
                assert listed.returncode == 2 and listed.stdout == "", listed
                error = listed.stderr.strip().splitlines()[-1]
                assert "Connection refused" not in error and "failed to connect" not in error, error
                assert error.startswith(f"error: the scheduler at localhost:{port} "), error
                assert "it may be stopped (SIGSTOP, a debugger)" in error, error
            finally:
                os.kill(cluster.scheduler.pid, signal.SIGCONT)
            client.timeout = 30
            # Resumed: a watch started while it was frozen catches up once it answers again.
            os.kill(cluster.scheduler.pid, signal.SIGSTOP)
            try:
                it = client.watch(task_id, follow=False, reconnect_timeout=60)
                resumer = threading.Timer(1.0, os.kill, (cluster.scheduler.pid, signal.SIGCONT))
                resumer.start()
                start = time.monotonic()
                events = list(it)
                resumer.join()
            finally:
                os.kill(cluster.scheduler.pid, signal.SIGCONT)
            assert events and events[0].sequence == first.sequence
            assert time.monotonic() - start < 60 + SLACK
    finally:
        cluster.close()


def test_a_quiet_watch_of_the_real_scheduler_answers_with_headers(tmp_path) -> None:
    # The scheduler sends WatchTask's headers at once, so a quiet watch counts as answered and is
    # not cancelled and reopened at the answer bound.
    from opentinker.scheduler.v1 import scheduler_pb2
    from opentinker_client.connection import SchedulerConnection
    from tests.support.procs import Cluster
    from tests.support.waiting import wait_for

    cluster = Cluster(tmp_path)
    try:
        cluster.start_scheduler()
        with RLClient(scheduler_url=cluster.url, api_key="", min_poll_interval=0) as client:
            task_id = client.submit_task(workload_type="lora_finetune", model="/m", hyperparameters=TINY_HP)
            last = list(client.watch(task_id, follow=False))[-1].sequence
        with SchedulerConnection(cluster.url, timeout=30, api_key="") as connection:
            request = scheduler_pb2.WatchTaskRequest(task_id=task_id, after_sequence=last)
            with connection.stream("WatchTask", request, answer_timeout=0.5) as responses:

                def drain() -> None:
                    try:
                        list(responses)
                    except ot.OpenTinkerError:
                        pass  # cancelled when the block is left

                threading.Thread(target=drain, daemon=True).start()
                wait_for(lambda: responses.answered, timeout=30, what="WatchTask's headers counted as an answer")
    finally:
        cluster.close()
