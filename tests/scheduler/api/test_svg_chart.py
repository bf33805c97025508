"""The dashboard's server-side SVG charts: ticks, escaping, one path per curve."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from opentinker_scheduler.api.svg_chart import Curve, line_chart, nice_ticks, sparkline

SVG = "{http://www.w3.org/2000/svg}"


def test_integer_ticks_are_whole_numbers_even_over_few_steps() -> None:
    assert nice_ticks(1, 3, 6, integer=True) == [1.0, 2.0, 3.0]
    assert all(t == int(t) for t in nice_ticks(1, 7, 6, integer=True))
    assert nice_ticks(0, 1, 5) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 1, 4) == [0.0, 0.5, 1.0]


def test_line_chart_is_valid_svg_with_escaped_labels_and_a_path_per_curve() -> None:
    svg = line_chart(
        [
            Curve("<b>a</b>", [1, 2, 3], [0.1, 0.5, 0.2], band=([0, 0.3, 0.1], [0.2, 0.7, 0.3])),
            Curve("b&c", [1], [1.0]),
        ],
        title='reward "x"',
    )
    root = ET.fromstring(svg)  # well-formed: every label escaped
    paths = root.findall(f"{SVG}path")
    assert [(p.get("data-label"), p.get("data-points")) for p in paths] == [("<b>a</b>", "3"), ("b&c", "1")]
    assert len(root.findall(f"{SVG}polygon")) == 1  # the band
    assert "<b>" not in svg


def test_empty_chart_and_sparkline_say_so_without_failing() -> None:
    assert "no points yet" in line_chart([Curve("r", [], [])])
    root = ET.fromstring(sparkline([1.0, 5.0, 3.0], lo=0, hi=10))
    assert len(root.find(f"{SVG}polyline").get("points").split()) == 3
    ET.fromstring(sparkline([]))
