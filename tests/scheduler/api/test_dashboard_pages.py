"""The dashboard's pages over real HTTP against a real in-process scheduler with auth off and no
trainer: pending tasks say their position and why they wait, bad query values are 400 with the
field, cancel needs the page's token, server strings are escaped, and the gRPC port points to the
HTTP port."""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request

import pytest

from opentinker_client import RLClient
from tests.support.security import LoopbackScheduler


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
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
