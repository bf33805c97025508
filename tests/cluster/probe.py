"""A client inside the simulated cluster, driven over stdin/stdout by the test outside it.

``python -m tests.cluster.probe`` reads one JSON request a line and answers one JSON line:
``{"op": "nodes"}``, ``{"op": "submit", "hyperparameters": {...}}``, ``{"op": "get", "task": id}``,
``{"op": "events", "task": id}``, ``{"op": "checkpoints", "task": id}``, ``{"op": "leader_call"}``
(the wall-clock time a leader-only call first succeeded), ``{"op": "s3_keys"}``. An error is
answered as ``{"error": "..."}``. ``python -m tests.cluster.probe watch <task>`` prints the
task's events as they come, one JSON line each, then ``{"end": true}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from opentinker_client import RLClient


def client() -> RLClient:
    return RLClient(scheduler_url=os.environ["SCHEDULER_URL"], min_poll_interval=0)


def event_fields(e) -> dict:
    return {
        "sequence": e.sequence,
        "kind": e.kind,
        "to_state": getattr(e, "to_state", ""),
        "reason": getattr(e, "reason", ""),
        "attempt": getattr(e, "attempt", 0),
        "node_id": getattr(e, "node_id", ""),
        "step": getattr(e, "step", 0),
        "final": getattr(e, "final", False),
    }


def task_fields(t) -> dict:
    return {
        "state": t.state,
        "attempt": t.attempt,
        "handed_back": t.handed_back,
        "node_id": t.node_id,
        "latest_step": t.latest_step,
        "checkpoint_step": t.checkpoint_step,
        "error": t.error,
    }


def leader_call(c: RLClient, hyperparameters: dict) -> float:
    """Submit (a leader-only call) until one is acknowledged; its time. The task is cancelled."""
    while True:
        try:
            task_id = submit(c, hyperparameters)
        except Exception:  # noqa: BLE001 - no leader yet: try again
            time.sleep(0.05)
            continue
        at = time.time()
        c.cancel(task_id)
        return at


def submit(c: RLClient, hyperparameters: dict) -> str:
    return c.submit_task(
        workload_type="full_rl",
        model="mlp",
        env_config={"env_id": "CartPole-v1"},
        hyperparameters=hyperparameters,
        max_attempts=3,
    )


def s3_keys() -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT"], region_name="us-east-1")
    keys, token = [], None
    while True:
        kw = {"Bucket": os.environ["S3_BUCKET"], **({"ContinuationToken": token} if token else {})}
        page = s3.list_objects_v2(**kw)
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


def serve() -> None:
    c = client()
    c.timeout = 5
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "nodes":
                out = sorted(n.node_id for n in c.list_nodes() if n.connected)
            elif op == "submit":
                out = submit(c, req["hyperparameters"])
            elif op == "get":
                out = task_fields(c.get_task(req["task"]))
            elif op == "events":
                out = [event_fields(e) for e in c.watch(req["task"], follow=False)]
            elif op == "checkpoints":
                out = [
                    {"step": k.step, "attempt": k.attempt, "node_id": k.node_id}
                    for k in c.list_checkpoints(req["task"])
                ]
            elif op == "leader_call":
                out = leader_call(c, req["hyperparameters"])
            elif op == "s3_keys":
                out = s3_keys()
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": out}
        except Exception as exc:  # noqa: BLE001 - the test reads it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def watch(task_id: str) -> None:
    try:
        for e in client().watch(task_id, reconnect_timeout=None):
            print(json.dumps(event_fields(e)), flush=True)
        print(json.dumps({"end": True}), flush=True)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["watch"]:
        watch(sys.argv[2])
    else:
        serve()
