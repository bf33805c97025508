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
