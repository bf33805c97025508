"""The trainer table and the spec registry agree: every (workload_type, env kind) a spec may
name has exactly one trainer, and the table names nothing the spec check would refuse."""

from __future__ import annotations

import importlib

import pytest

import opentinker_common.spec  # noqa: F401 - registers every config family
from opentinker_common.spec.registry import workload_env_kinds
from opentinker_trainer.context import UserError
from opentinker_trainer.workloads import TRAINERS, trainer_for


def test_the_table_has_exactly_the_registered_pairs():
    assert set(TRAINERS) == set(workload_env_kinds())


@pytest.mark.parametrize("pair", sorted(TRAINERS))
def test_every_row_names_a_function_that_exists(pair):
    module, _, function = TRAINERS[pair].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert trainer_for(*pair) is getattr(importlib.import_module(module), function)


def test_an_unknown_pair_is_a_user_error_naming_it():
    with pytest.raises(UserError, match=r"'sft'.*kind 'gym'"):
        trainer_for("sft", "gym")
