"""`opentinker plot`'s drawing, in-process: one marker per finite point, nothing to plot is an
error, the output folder must exist and the file is written with the ordinary permissions."""

from __future__ import annotations

import os

import pytest


def test_plot_has_one_marker_per_finite_point(tmp_path) -> None:
    from opentinker_client.cli.plot import plot_history

    history = [
        (1, {"reward": 0.1, "loss": 1.0}),
        (2, {"reward": float("nan"), "loss": 0.9}),
        (3, {"reward": 0.3}),
        (5, {"reward": 0.5, "loss": 0.7}),
    ]
    out = tmp_path / "c.svg"
    assert plot_history(history, out) == {"reward": 3, "loss": 3}
    import xml.etree.ElementTree as ET

    root = ET.parse(out).getroot()
    groups = {g.get("id"): g for g in root.iter("{http://www.w3.org/2000/svg}g")}
    for key in ("reward", "loss"):  # one marker per finite point, in the curve's own group
        assert len(list(groups[f"curve-{key}"].iter("{http://www.w3.org/2000/svg}use"))) == 3
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_history([(1, {"kl": 0.1})], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_plot_needs_an_existing_folder_and_writes_an_ordinary_file(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from opentinker_client.cli.plot import plot_history

    history = [(1, {"reward": 0.1, "loss": 1.0}), (2, {"reward": 0.5, "loss": 0.5})]
    with pytest.raises(FileNotFoundError, match="no such folder"):
        plot_history(history, tmp_path / "missing" / "x.png")
    assert not (tmp_path / "missing").exists()
    out = tmp_path / "x.png"
    plot_history(history, out)
    umask = os.umask(0)
    os.umask(umask)
    assert (os.stat(out).st_mode & 0o777) == (0o666 & ~umask)


def test_overlay_smoothing_clipped_bands_and_integer_ticks(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import xml.etree.ElementTree as ET

    from opentinker_client.cli.plot import plot_runs

    a = [
        (s, 100.0 + s, {"env_steps": 64.0 * s, "completion/truncated_frac": 0.9, "completion/truncated_frac_std": 0.5})
        for s in (1, 2, 3)
    ]
    b = [(s, 200.0 + 2 * s, {"env_steps": 32.0 * s, "completion/truncated_frac": 0.1}) for s in (1, 2)]
    out = tmp_path / "o.svg"
    counts = plot_runs([("a", a), ("b", b)], out, keys=("completion/truncated_frac",), x="env_steps", smooth=0.5)
    assert counts == {"completion/truncated_frac": 5}
    root = ET.parse(out).getroot()
    ids = {g.get("id") for g in root.iter("{http://www.w3.org/2000/svg}g")}
    assert {"curve-completion/truncated_frac-0", "curve-completion/truncated_frac-1"} <= ids
    text = out.read_text()
    assert "env steps (smoothing 0.5)" in text
    with pytest.raises(ValueError, match="x: expected one of step, env_steps, tokens, time"):
        plot_runs([("a", a)], tmp_path / "x.png", x="epochs")
    with pytest.raises(ValueError, match="nothing to plot: no finite reward, loss value against tokens"):
        plot_runs([("a", a)], tmp_path / "x.png", x="tokens")


def test_bands_are_clipped_to_the_metric_range(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from opentinker_client.cli.plot import plot_runs

    bands = []
    real = Axes.fill_between
    monkeypatch.setattr(
        Axes, "fill_between", lambda self, x, lo, hi, **kw: bands.append((lo, hi)) or real(self, x, lo, hi, **kw)
    )
    pts = [(s, 0.0, {"success": 0.9, "success_std": 0.4, "reward": -1.0, "reward_std": 2.0}) for s in (1, 2)]
    plot_runs([("", pts)], tmp_path / "b.png", keys=("success", "reward"))
    (lo, hi), (rlo, rhi) = bands
    assert min(lo) >= 0.0 and max(hi) <= 1.0  # a rate stays in [0, 1]
    assert rlo == [-3.0, -3.0] and rhi == [1.0, 1.0]  # reward is unbounded


def test_step_axes_get_whole_number_ticks(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from opentinker_client.cli import plot as plot_mod

    seen = []
    from matplotlib.figure import Figure

    real = Figure.savefig

    def spy(self, *a, **kw):
        seen.extend(t for ax in self.axes for t in ax.get_xticks())
        return real(self, *a, **kw)

    Figure.savefig = spy
    try:
        plot_mod.plot_runs(
            [("", [(1, 0.0, {"reward": 0.1}), (2, 0.0, {"reward": 0.2}), (3, 0.0, {"reward": 0.3})])],
            tmp_path / "t.png",
            keys=("reward",),
        )
    finally:
        Figure.savefig = real
    assert seen and all(float(t).is_integer() for t in seen)


def test_plot_draws_ppo_on_environments_against_env_steps_by_default() -> None:
    from opentinker.common.v1 import common_pb2
    from opentinker_client._convert import task_from_proto
    from opentinker_client.cli.commands import _default_x

    def task(workload: str, env: dict):
        spec = common_pb2.TaskSpec(workload_type=workload, model="mlp" if workload == "full_rl" else "org/m")
        spec.env_config.update(env)
        return task_from_proto(common_pb2.Task(task_id=f"task-{workload}", spec=spec))

    ppo = task("full_rl", {"env_id": "CartPole-v1"})
    grpo = task("lora_finetune", {"env_id": "arithmetic"})
    assert _default_x([ppo]) == _default_x([ppo, ppo]) == "env_steps"  # sample efficiency
    assert _default_x([grpo]) == "step" and _default_x([ppo, grpo]) == "step"  # no common unit: steps
