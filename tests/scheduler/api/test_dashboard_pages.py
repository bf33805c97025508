"""The dashboard's pages over real HTTP against a real in-process scheduler with auth off and no
trainer: pending tasks say their position and why they wait, bad query values are 400 with the
field, cancel needs the page's token, server strings are escaped, and the gRPC port points to the
HTTP port. With auth on (keys as ``Authorization: Bearer``; nodes registered on the scheduler's
loop, no trainer process): the cluster page shows disconnected nodes and each node's model hosts
and LoRA tenants, naming only the visitor's own tasks and models."""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_client import RLClient
from tests.support.security import LoopbackScheduler


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("dash") / "state", "heartbeat_interval: 0.5\n", http_port=0) as s:
        yield s


def test_queue_task_page_and_cancel_with_auth_off(sched) -> None:
    base = f"http://127.0.0.1:{sched.running.http.port}"
    with RLClient(sched.target) as client:
        first = client.submit_task(workload_type="full_rl", model="mlp", env_config={"env_id": "CartPole-v1"})
        second = client.submit_task(
            workload_type="full_rl", model="mlp", env_config={"env_id": "CartPole-v1"}, name="</td><b>x"
        )
        status, page = _get(base + "/ui/queue")
        assert status == 200
        rows = re.findall(r'<tr class="pending" data-task="([^"]+)"><td>(\d+) of (\d+)</td>', page)
        assert [(t, p) for t, p, _ in rows] == [(first, "1"), (second, "2")]
        assert "no trainer node" in page or "no node" in page  # why it waits, from the scheduler
        assert "&lt;/td&gt;&lt;b&gt;x" in page and "</td><b>x" not in page
        status, page = _get(f"{base}/ui/task/{first}")
        assert status == 200 and 'id="state">pending' in page and "&quot;env_id&quot;: &quot;CartPole-v1&quot;" in page
        token = re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)
        post = urllib.request.Request(
            f"{base}/ui/task/{first}/cancel", data=urllib.parse.urlencode({"csrf": "x" + token[1:]}).encode()
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(post, timeout=30)
        assert err.value.code == 403 and client.get_task(first).state == "pending"
        post = urllib.request.Request(
            f"{base}/ui/task/{first}/cancel", data=urllib.parse.urlencode({"csrf": token, "reason": "r1"}).encode()
        )
        with urllib.request.urlopen(post, timeout=30) as resp:  # 303 to the task page, followed
            assert 'id="state">cancelled' in resp.read().decode()
        assert client.get_task(first).error == "cancelled by user: r1"
        status, page = _get(f"{base}/ui/task/{second}/charts")
        assert status == 200 and "No metric points yet" in page


@pytest.mark.parametrize(
    ("path", "code", "needle"),
    [
        ("/ui/compare?task=task-x&x=epoch", 404, "not found"),
        ("/ui/compare?x=epoch&task=", 400, "x: expected one of step, env_steps, tokens, time"),
        ("/ui/compare?smooth=2", 400, "smooth: expected a number in [0, 1)"),
        ("/ui/task/task-x/checkpoint/abc", 400, "step: expected a whole number"),
        ("/ui/nope<script>", 404, "no page /ui/nope&lt;script&gt;"),
    ],
)
def test_bad_requests_say_what_was_expected(sched, path, code, needle) -> None:
    status, page = _get(f"http://127.0.0.1:{sched.running.http.port}{path}")
    assert status == code and needle in page, page[-400:]


def test_grpc_port_points_to_the_dashboard(sched) -> None:
    status, page = _get(f"http://{sched.target}/")
    assert status == 200 and f"HTTP port, {sched.running.http.port}" in page


def _node_section(page: str, node_id: str) -> str:
    match = re.search(rf'<section class="node [a-z]+" data-node="{node_id}">.*?</section>', page, re.S)
    assert match, page[-2000:]
    return match.group(0)


def test_cluster_shows_model_hosts_and_disconnected_nodes_naming_only_the_visitors_tasks(tmp_path) -> None:
    config = "auth: {enabled: true}\nheartbeat_interval: 0.5\n"
    with LoopbackScheduler(tmp_path / "state", config, http_port=0) as s:
        base = f"http://127.0.0.1:{s.running.http.port}"
        with RLClient(s.target, api_key=s.admin_key) as root:
            alice_key, bob_key = root.keys.create("alice", "user")[1], root.keys.create("bob", "user")[1]
        devices = [C.Device(index=i, uuid=f"u{i}", name="g", simulated=True) for i in (0, 1)]
        node, _ = s.do(s.core.node_register, N.Register(node_id="host-node", devices=devices, max_tasks=8,
                                                         tenants_per_host=4))  # fmt: skip
        gone, _ = s.do(s.core.node_register, N.Register(node_id="gone-node", max_tasks=1))
        s.do(s.core.node_disconnected, gone, gone.generation, goodbye=False)
        with RLClient(s.target, api_key=alice_key) as alice, RLClient(s.target, api_key=bob_key) as bob:
            a = alice.submit_task(workload_type="lora_finetune", model="org/shared", gpu_count=1)
            b = bob.submit_task(workload_type="lora_finetune", model="org/shared", gpu_count=1)
            c = bob.submit_task(workload_type="lora_finetune", model="bob/private-model", gpu_count=1)
            assert {alice.get_task(a).state, bob.get_task(b).state, bob.get_task(c).state} == {"assigned"}
        shared = C.ModelHost(model="org/shared", device_indices=[0], task_ids=[a, b], pid=1, max_tenants=4,
                             dtype="bfloat16")  # fmt: skip
        private = C.ModelHost(model="bob/private-model", device_indices=[1], task_ids=[c], pid=2, max_tenants=4)
        idle = C.ModelHost(model="carol/left-model", device_indices=[1], pid=3, max_tenants=4)  # its tenants gone
        s.do(setattr, node, "model_hosts", [shared, private, idle])

        status, page = _get(f"{base}/ui/cluster", alice_key)
        assert status == 200 and "alice (user)" in page
        assert "1 node(s) connected, 1 disconnected" in page
        assert '<span class="badge disconnected">disconnected</span>' in _node_section(page, "gone-node")
        section = _node_section(page, "host-node")
        rows = re.findall(r'<tr class="model-host".*?</tr>', section, re.S)
        assert len(rows) == 3
        assert 'data-model="org/shared"' in rows[0] and "bfloat16" in rows[0]
        assert f'<a href="/ui/task/{a}">{a}</a>, 1 of other owners' in rows[0] and "2 of 4" in rows[0]
        assert "(another owner's model)" in rows[1] and "1 of 4: 1 of other owners" in rows[1]
        assert "(no tenants)" in rows[2] and "0 of 4" in rows[2] and "carol/left-model" not in page
        assert b not in page and c not in page and "bob/private-model" not in page  # bob's names stay bob's

        status, page = _get(f"{base}/ui/cluster", s.admin_key)
        assert status == 200 and all(t in page for t in (a, b, c)) and "bob/private-model" in page

        # Her task's page: attempts, events, the spec as resolved, nothing fetched from outside.
        status, page = _get(f"{base}/ui/task/{a}", alice_key)
        assert status == 200 and 'id="state">assigned' in page
        attempts = re.search(r'<table id="attempts">.*?</table>', page, re.S).group(0)
        assert re.search(r"<tr><td>1</td><td>[0-9:]+</td><td>host-node</td><td>assigned</td>", attempts), attempts
        events = re.search(r'<table id="events">.*?</table>', page, re.S).group(0)
        assert "pending → assigned" in events and "placed on host-node GPUs [0]" in events
        assert "&quot;lora_rank&quot;: 16" in page  # a default she did not set
        assert not re.search(r'(?:src|href|action)="(?:[a-z]+:)?//', page)  # works offline
        # Her page's cancel token does not cancel bob's task: "not found", as over gRPC; nothing changes.
        token = re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)
        post = urllib.request.Request(
            f"{base}/ui/task/{b}/cancel",
            data=urllib.parse.urlencode({"csrf": token}).encode(),
            headers={"Authorization": f"Bearer {alice_key}"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(post, timeout=30)
        assert err.value.code == 404 and "not found" in err.value.read().decode()
        with RLClient(s.target, api_key=bob_key) as bob:
            assert bob.get_task(b).state == "assigned"

        # The compare view smooths: a reward alternating 0, 1, 0, 1 ... is two levels raw, more smoothed.
        def run_and_report() -> None:
            s.core.node_report(node, N.TaskReport(task_id=a, attempt=1, state=C.TASK_STATE_RUNNING))
            points = [C.MetricPoint(step=n, values={"reward": float(n % 2)}) for n in range(1, 9)]
            s.core.node_report(node, N.TaskReport(task_id=a, attempt=1, metrics=points))

        s.do(run_and_report)

        def reward_ys(smooth: float) -> list[float]:
            status, page = _get(f"{base}/ui/compare?task={a}&x=step&smooth={smooth}", alice_key)
            assert status == 200
            d = re.search(r'id="compare-reward".*?<path class="curve"[^>]*d="([^"]+)"', page, re.S).group(1)
            return [float(y) for _, y in re.findall(r"[ML]([-\d.]+),([-\d.]+)", d)]

        raw, smoothed = reward_ys(0), reward_ys(0.9)
        assert len(raw) == len(smoothed) == 8 and len(set(raw)) == 2 and len(set(smoothed)) > 2
        status, page = _get(f"{base}/ui/cluster")  # no key: the login form, nothing else
        assert 'id="login"' in page and "host-node" not in page
