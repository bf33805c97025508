"""Whether some connected trainer node can write a task's ``spec.tracking`` loggers. Pure, no I/O.

Policy: each node says at register which loggers its Python can write (``Register.tracking_loggers``,
the optional extras installed with it). A task that names a logger none of the connected nodes
can write is refused at submit, naming the field and the extra to install, instead of waiting to
be placed and then failing at its worker's start. Nothing is refused while no node is connected
(the task waits for one, which may have the extra) or while any connected node did not say (an
agent older than the field). In a mixed cluster the core leaves the nodes without a task's loggers
out of its placement (``NodeLedger.nodes_without``, ``RoundHooks.left_out``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from opentinker_common.spec.tracking import EXTRAS

__all__ = ["NodeLoggers", "unwritable_logger"]


@dataclass(frozen=True)
class NodeLoggers:
    """A connected node's ``node_id`` and the loggers it can write (None: it did not say)."""

    node_id: str
    loggers: frozenset[str] | None


def unwritable_logger(named: Sequence[str], nodes: Sequence[NodeLoggers]) -> str | None:
    """Why a task naming the loggers ``named`` (keys of ``spec.tracking``: ``"tensorboard"``,
    ``"mlflow"``, ``"wandb"``) is refused, given the connected ``nodes``; None when it is not.

    Returns:
        ``"spec.tracking.mlflow: no connected trainer node can write mlflow runs (the mlflow
        package is not installed on n1, n2); install it on the trainer nodes with pip install
        'opentinker[mlflow]', or drop tracking.mlflow from the spec"`` for the first such logger.
    """
    if not named or not nodes or any(n.loggers is None for n in nodes):
        return None
    for logger in named:
        if any(logger in (n.loggers or ()) for n in nodes):
            continue
        module, extra = EXTRAS[logger]
        ids = sorted(n.node_id for n in nodes)
        where = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        return (
            f"spec.tracking.{logger}: no connected trainer node can write {logger} runs (the {module} package "
            f"is not installed on {where}); install it on the trainer nodes with pip install "
            f"'opentinker[{extra}]', or drop tracking.{logger} from the spec"
        )
    return None
