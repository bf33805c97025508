"""Which ``spec.tracking`` loggers some connected node can write (:func:`unwritable_logger`)."""

from __future__ import annotations

from opentinker_scheduler.policy.tracking import NodeLoggers, unwritable_logger


def _node(node_id: str, *loggers: str) -> NodeLoggers:
    return NodeLoggers(node_id, frozenset(loggers))


def test_a_logger_no_connected_node_can_write_is_named_with_its_extra() -> None:
    nodes = [_node("n2", "tensorboard"), _node("n1", "tensorboard", "wandb")]
    assert unwritable_logger(["tensorboard", "wandb"], nodes) is None  # each written by some node
    assert unwritable_logger(["tensorboard", "mlflow", "wandb"], nodes) == (
        "spec.tracking.mlflow: no connected trainer node can write mlflow runs (the mlflow package is not "
        "installed on n1, n2); install it on the trainer nodes with pip install 'opentinker[mlflow]', or drop "
        "tracking.mlflow from the spec"
    )
    many = [_node(f"n{i}") for i in range(7)]
    assert "(the tensorboardX package is not installed on n0, n1, n2, n3, n4 and 2 more)" in unwritable_logger(
        ["tensorboard"], many
    )


def test_nothing_is_refused_without_nodes_or_when_a_node_did_not_say() -> None:
    assert unwritable_logger(["mlflow"], []) is None  # the task waits for a node, which may have it
    assert unwritable_logger(["mlflow"], [_node("new"), NodeLoggers("old-agent", None)]) is None
    assert unwritable_logger([], [_node("n1")]) is None
