"""`make bench-rlvr`'s paired comparison of two evaluations of the same held-out problems: the
wrong->right / right->wrong counts and the exact McNemar p-value, on small cases worked by hand."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_rlvr", REPO / "scripts" / "bench_rlvr.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("gained", "lost", "p"),
    [
        (0, 0, 1.0),  # no discordant problem: no evidence either way
        (1, 1, 1.0),  # 2 * P(X <= 1 | n=2) = 2 * 3/4, capped at 1
        (5, 0, 2 / 32),  # all five one way: 2 * (1/2)^5
        (0, 5, 2 / 32),  # two-sided: the direction does not matter
        (6, 1, 2 * (1 + 7) / 128),  # 2 * P(X <= 1 | n=7) = 0.125
        (10, 2, 2 * (1 + 12 + 66) / 4096),  # 0.0386: below 0.05
        (3, 3, 1.0),
    ],
)
def test_mcnemar_exact_matches_the_binomial_tail_worked_by_hand(bench, gained, lost, p) -> None:
    assert math.isclose(bench.mcnemar_exact(gained, lost), p, rel_tol=1e-12)


def test_mcnemar_exact_agrees_with_scipy_binomtest(bench) -> None:
    stats = pytest.importorskip("scipy.stats")
    for gained, lost in [(0, 1), (2, 9), (7, 7), (17, 10), (30, 12), (0, 40)]:
        want = stats.binomtest(gained, gained + lost, 0.5).pvalue
        assert math.isclose(bench.mcnemar_exact(gained, lost), want, rel_tol=1e-9), (gained, lost)


def test_mcnemar_exact_refuses_negative_counts(bench) -> None:
    with pytest.raises(ValueError, match="counts must be >= 0"):
        bench.mcnemar_exact(-1, 3)


def test_paired_comparison_counts_only_the_problems_that_changed(bench) -> None:
    before = [True, True, False, False, False, True]
    after = [True, False, True, True, False, True]  # one lost, two gained, three alike
    assert bench.paired_comparison(before, after) == {"gained": 2, "lost": 1, "p": 1.0}


def test_paired_comparison_refuses_evaluations_of_different_problems(bench) -> None:
    with pytest.raises(ValueError, match="same problems: 3 vs 2"):
        bench.paired_comparison([True, False, True], [True, False])
