"""The web dashboard in a real browser (Debian's Chromium driven by selenium through chromedriver)
against a real scheduler and trainer with auth on: log in with a user's key, see the cluster, a
running task's curve gaining points without a reload, two tasks on one compare chart, cancel from
the page, and never another owner's task. The same running task also carries ``spec.tracking``:
its TensorBoard and MLflow runs are read back with those tools' own readers while it runs (one
cluster for both keeps the suite's time down).

Chromium comes from the system (``make test-deps`` installs ``chromium chromium-driver`` as root or
with passwordless sudo); without it the module skips, saying so, except where
``OPENTINKER_REQUIRE_BROWSER=1`` (CI, ``.ci/run``): there it fails. Screenshots go to the test's
tmp folder; with ``OPENTINKER_DOCS_SCREENSHOTS=1`` the cluster and compare ones are also copied
to ``docs/images/``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from opentinker_client import InvalidArgumentError, RLClient
from tests.support.procs import Cluster
from tests.support.waiting import wait_progress

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"

# PPO on CartPole: 2 envs x 32 steps = 64 env steps an update, a fraction of a second each.
SHORT = {"total_timesteps": 64 * 6, "num_envs": 2, "num_steps": 32, "checkpoint_every": 3, "hidden_sizes": [16]}
LONG = {**SHORT, "total_timesteps": 64 * 5000, "checkpoint_every": 2}
ENV = {"env_id": "CartPole-v1"}
#: Seconds a page load after a click may take (the driver's page-load timeout too).
PAGE_LOAD_S = 60
#: Most points of any telemetry sparkline on the page.
SAMPLES = (
    "return Math.max(0, ...Array.from(document.querySelectorAll('svg.spark polyline'))"
    ".map(p => p.points.numberOfItems))"
)
#: A name a page must show as text, never as markup.
TRICKY_NAME = '<img src=x onerror="window.pwned=1">'


def _missing_browser() -> str:
    """What this machine lacks to drive Chromium (empty when nothing)."""
    if not (CHROMIUM and CHROMEDRIVER):
        return (
            "Chromium and chromedriver are not installed "
            "(as root: make test-deps, or apt-get install chromium chromium-driver)"
        )
    try:
        import selenium.webdriver  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return ""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = _missing_browser()
    if missing:  # CI (.ci/run) sets OPENTINKER_REQUIRE_BROWSER=1: there a missing browser fails the test
        (pytest.fail if os.environ.get("OPENTINKER_REQUIRE_BROWSER") == "1" else pytest.skip)(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(PAGE_LOAD_S)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    """A scheduler with auth on, one trainer, and three tasks: alice's short and long ones, and bob's."""
    tmp = tmp_path_factory.mktemp("dashboard")
    track = tmp / "tracking"
    cluster = Cluster(
        tmp, f"heartbeat_interval: 0.5\nlease: 3\nauth: {{enabled: true}}\npaths: {{tracking_dirs: [{track}]}}\n"
    )
    try:
        cluster.start_scheduler()
        with RLClient(cluster.url, api_key=cluster.admin_key()) as root:
            _, node_key = root.keys.create("rack-1", "node")
            _, alice_key = root.keys.create("alice", "user")
            _, bob_key = root.keys.create("bob", "user")
            cluster.start_trainer("node-a", "--api-key", node_key, "--simulate-gpus", "2")
            wait_progress(
                lambda: any(n.connected for n in root.list_nodes()) or None,
                lambda: cluster.said_about("node-a"),
                what="node-a connected",
            )
        with RLClient(cluster.url, api_key=alice_key) as alice, RLClient(cluster.url, api_key=bob_key) as bob:
            short = alice.submit_task(
                workload_type="full_rl", model="mlp", env_config=ENV, hyperparameters=SHORT, name=TRICKY_NAME
            )
            tracking = {
                "tensorboard": str(track / "tb"),
                "mlflow": {"uri": f"file://{track / 'mlruns'}", "experiment": "ppo-cartpole"},
            }
            long = alice.submit_task(
                workload_type="full_rl",
                model="mlp",
                env_config=ENV,
                hyperparameters=LONG,
                name="long run",
                tracking=tracking,
            )
            with pytest.raises(InvalidArgumentError, match=r"spec.tracking.tensorboard: expected a folder under"):
                alice.submit_task(workload_type="full_rl", model="mlp", env_config=ENV, tracking={"tensorboard": "/x"})
            hidden = bob.submit_task(
                workload_type="full_rl", model="mlp", env_config=ENV, hyperparameters=LONG, name="bob's secret"
            )
        with RLClient(cluster.url, api_key=cluster.admin_key(), min_poll_interval=0) as admin:
            yield dict(
                track=track,
                cluster=cluster,
                admin=admin,
                alice=alice_key,
                short=short,
                long=long,
                hidden=hidden,
                base=f"http://127.0.0.1:{cluster.http_port}",
                shots=tmp / "screenshots",
            )
    finally:
        cluster.close()


def _wait(dash, task_id: str, state: str, what=lambda t: True):
    """The task (asked with the admin key) once in ``state`` with ``what(task)``, following its progress."""
    admin = dash["admin"]

    def arrived():
        t = admin.get_task(task_id)
        return t if t.state == state and what(t) else None

    return wait_progress(arrived, lambda: dash["cluster"].said_about(task_id), what=f"task {task_id} {state}")


def _shot(browser, dash, name: str) -> Path:
    dash["shots"].mkdir(exist_ok=True)
    path = dash["shots"] / f"{name}.png"
    browser.save_screenshot(str(path))
    if os.environ.get("OPENTINKER_DOCS_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, DOCS_IMAGES / f"dashboard-{name}.png")
    return path


def _loaded(browser, condition, what: str):
    """``condition(browser)`` once true: a page the browser is loading after a click (a page load
    on loopback, bounded by the driver's page-load timeout, not by training progress)."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, PAGE_LOAD_S, ignored_exceptions=(Exception,)).until(condition, message=what)


def _points(browser, chart_id: str) -> list[int]:
    """The point counts of a chart's curves, read in one script: the page redraws a live chart
    between two WebDriver calls (a curve found by one call may be gone by the next)."""
    return browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), p => parseInt(p.getAttribute('data-points')))",
        f"#{chart_id} path.curve",
    )


def test_login_then_cluster_shows_the_node(browser, dash) -> None:
    from selenium.webdriver.common.by import By

    browser.get(dash["base"] + "/")
    assert browser.find_element(By.ID, "login")  # auth on: the login form first
    browser.find_element(By.ID, "api_key").send_keys("otk_00000000_" + "x" * 43)
    browser.find_element(By.ID, "login-button").click()
    error = _loaded(browser, lambda b: b.find_element(By.ID, "login-error").text, "the login error")
    assert "unknown" in error or "not accepted" in error
    browser.find_element(By.ID, "api_key").send_keys(dash["alice"])
    browser.find_element(By.ID, "login-button").click()
    _loaded(browser, lambda b: b.current_url.endswith("/ui/cluster"), "the cluster page after login")
    node = browser.find_element(By.CSS_SELECTOR, 'section.node[data-node="node-a"]')
    assert "connected" in node.text and "alice (user)" in browser.find_element(By.TAG_NAME, "nav").text
    cookie = browser.get_cookie("otk_key")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # page scripts cannot read the key
    # wait for a few telemetry samples, so the screenshot has sparklines
    wait_progress(
        lambda: browser.refresh() or (browser.execute_script(SAMPLES) >= 5 or None),
        lambda: dash["cluster"].said_about("node-a"),
        what="host telemetry sparkline",
    )
    # ... per GPU too: node-a's two (simulated) GPUs, each with a utilization series.
    gpu_points = browser.execute_script(
        "return Array.from(document.querySelectorAll('section.node[data-node=\"node-a\"] svg.spark'))"
        ".filter(s => s.querySelector('title').textContent === 'utilization %')"
        ".map(s => s.querySelector('polyline') ? s.querySelector('polyline').points.numberOfItems : 0)"
    )
    assert len(gpu_points) == 2 and min(gpu_points) >= 2, gpu_points
    section = browser.find_element(By.CSS_SELECTOR, 'section.node[data-node="node-a"]')
    assert section.text.count("(simulated)") == 2  # each simulated GPU is marked
    _shot(browser, dash, "cluster")


def test_running_task_curve_gains_points_live(browser, dash) -> None:
    cluster = dash["cluster"]
    _wait(dash, dash["long"], "running", lambda t: t.latest_step >= 1)
    browser.get(f"{dash['base']}/ui/task/{dash['long']}")
    browser.execute_script("window.sameDocument = true")  # gone if the page reloads
    first = _points(browser, "chart-reward")
    assert first and first[0] >= 1
    wait_progress(
        lambda: (_points(browser, "chart-reward") or [0])[0] > first[0] or None,
        lambda: cluster.said_about(dash["long"]),
        what="the reward curve gaining points",
    )
    assert browser.execute_script("return window.sameDocument") is True  # updated in place, no reload
    assert _points(browser, "chart-kl") and _points(browser, "chart-throughput")


def test_compare_two_tasks_on_one_chart(browser, dash) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _wait(dash, dash["short"], "succeeded")
    browser.get(dash["base"] + "/ui/tasks")
    names = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#tasks td:nth-child(3)")]
    assert TRICKY_NAME in names  # shown as text, not run as markup
    assert browser.execute_script("return window.pwned === undefined")
    # The task page links its checkpoints; the link is a tar of the checkpoint's files.
    browser.get(f"{dash['base']}/ui/task/{dash['short']}")
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "#checkpoints a.download")]
    assert [link.rsplit("/", 1)[1] for link in links] == ["3", "6"]
    req = urllib.request.Request(links[-1], headers={"Cookie": f"otk_key={dash['alice']}"})
    with urllib.request.urlopen(req, timeout=30) as resp, tarfile.open(fileobj=io.BytesIO(resp.read())) as tar:
        names = tar.getnames()
    assert f"{dash['short']}-step6/policy.pt" in names and f"{dash['short']}-step6/policy.json" in names
    browser.get(dash["base"] + "/ui/tasks")
    for task_id in (dash["short"], dash["long"]):
        browser.find_element(By.CSS_SELECTOR, f'input[name="task"][value="{task_id}"]').click()
    browser.find_element(By.ID, "compare-selected").click()
    _loaded(browser, lambda b: "/ui/compare?" in b.current_url, "the compare page")
    labels = [
        p.get_attribute("data-label") for p in browser.find_elements(By.CSS_SELECTOR, "#compare-reward path.curve")
    ]
    assert len(labels) == 2 and {label.split()[0] for label in labels} == {dash["short"], dash["long"]}
    # PPO is drawn against env steps by default; switch to steps with smoothing.
    assert "env steps" in browser.find_element(By.ID, "compare-reward").text
    Select(browser.find_element(By.ID, "x-axis")).select_by_value("step")
    smooth = browser.find_element(By.ID, "smooth")
    smooth.clear()
    smooth.send_keys("0.6")
    browser.find_element(By.CSS_SELECTOR, "#compare-form button").click()
    _loaded(browser, lambda b: "x=step" in b.current_url and "smooth=0.6" in b.current_url, "the redrawn compare page")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#compare-reward path.curve")) == 2
    assert "step" in browser.find_element(By.ID, "compare-reward").text
    _shot(browser, dash, "compare")


def test_another_owners_task_is_not_visible(browser, dash) -> None:
    from selenium.webdriver.common.by import By

    hidden = dash["hidden"]
    _wait(dash, hidden, "running")  # on node-a's list of running tasks now
    for page in ("/ui/tasks", "/ui/queue", "/ui/cluster"):
        browser.get(dash["base"] + page)
        assert hidden not in browser.page_source and "bob" not in browser.page_source, page
    browser.get(dash["base"] + "/ui/queue")  # alice's running task: progress of PPO's updates, and an ETA
    progress = browser.find_element(By.CSS_SELECTOR, f'tr.running[data-task="{dash["long"]}"] progress')
    assert progress.get_attribute("max") == str(LONG["total_timesteps"] // (LONG["num_envs"] * LONG["num_steps"]))
    assert progress.find_element(By.XPATH, "../following-sibling::td[1]").text != "-"  # the ETA
    browser.get(dash["base"] + "/ui/cluster")
    assert "1 task(s) of other owners" in browser.find_element(By.CSS_SELECTOR, 'section.node[data-node="node-a"]').text
    browser.get(f"{dash['base']}/ui/task/{hidden}")
    assert "not found" in browser.find_element(By.TAG_NAME, "body").text
    browser.get(f"{dash['base']}/ui/compare?task={hidden}")
    assert "not found" in browser.find_element(By.TAG_NAME, "body").text
    browser.get(f"{dash['base']}/ui/task/{hidden}/checkpoint/0")
    assert "not found" in browser.find_element(By.TAG_NAME, "body").text


def _tensorboard_steps(folder) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars("reward")] if "reward" in acc.Tags()["scalars"] else []


def _mlflow_checkpoints(mlruns, run) -> list | None:
    path = mlruns / run.info.experiment_id / run.info.run_id / "artifacts" / "checkpoints.json"
    return json.loads(path.read_text())["checkpoints"] if path.exists() else None


def test_running_task_writes_tensorboard_and_mlflow_as_steps_happen(dash) -> None:
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")
    pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this
    from mlflow.tracking import MlflowClient

    long, tb, mlruns = dash["long"], dash["track"] / "tb", dash["track"] / "mlruns"
    ml = MlflowClient(tracking_uri=f"file://{mlruns}")

    def run_and_history():
        exp = ml.get_experiment_by_name("ppo-cartpole")
        runs = ml.search_runs([exp.experiment_id]) if exp is not None else []
        if not runs:
            return None
        history = ml.get_metric_history(runs[0].info.run_id, "reward")
        return (runs[0], history) if len(history) >= 3 and len(_tensorboard_steps(tb / long)) >= 3 else None

    run, history = wait_progress(
        run_and_history, lambda: dash["cluster"].said_about(long), what="3 steps in TensorBoard and MLflow"
    )
    assert dash["admin"].get_task(long).state == "running"  # written live, not exported at the end
    assert [m.step for m in history][:3] == [1, 2, 3]
    assert _tensorboard_steps(tb / long)[:3] == [1, 2, 3]
    assert run.info.run_name == long and run.data.tags["opentinker_task_id"] == long
    assert run.data.params["num_envs"] == "2" and run.data.params["learning_rate"]  # resolved: defaults too
    assert "loss.entropy" in ml.get_run(run.info.run_id).data.metrics  # loss/entropy: "/" becomes "."
    spec = json.loads((mlruns / run.info.experiment_id / run.info.run_id / "artifacts" / "spec.json").read_text())
    assert spec["tracking"]["mlflow"]["experiment"] == "ppo-cartpole" and spec["env"]["env_id"] == "CartPole-v1"
    checkpoints = wait_progress(
        lambda: _mlflow_checkpoints(mlruns, run),
        lambda: dash["cluster"].said_about(long),
        what="a checkpoint in MLflow",
    )
    assert checkpoints[0]["step"] == LONG["checkpoint_every"] and checkpoints[0]["path"].endswith("step_2")


def test_cancel_needs_the_page_token_then_cancels(browser, dash) -> None:
    from selenium.webdriver.common.by import By

    long = dash["long"]
    # A forged POST with the key but without the page's token is refused and changes nothing.
    req = urllib.request.Request(
        f"{dash['base']}/ui/task/{long}/cancel",
        data=urllib.parse.urlencode({"csrf": "forged"}).encode(),
        headers={"Cookie": f"otk_key={dash['alice']}"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 403
    assert dash["admin"].get_task(long).state == "running"
    browser.get(f"{dash['base']}/ui/task/{long}")
    browser.find_element(By.CSS_SELECTOR, "#cancel-form input[name=reason]").send_keys("enough")
    browser.find_element(By.ID, "cancel").click()
    _loaded(browser, lambda b: b.find_element(By.ID, "state").text == "cancelled", "the cancelled task page")
    task = _wait(dash, long, "cancelled")
    assert "enough" in task.error
    assert not browser.find_elements(By.ID, "cancel-form")  # a finished task has no cancel button
