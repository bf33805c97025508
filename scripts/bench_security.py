#!/usr/bin/env python3
"""What API keys, the audit log and TLS cost per call: the same sequential SubmitTask and GetTask
calls against a loopback scheduler with security off (the baseline, measured in the same run),
with API keys on, and with API keys + TLS. Prints microseconds per call and the ratio to the
baseline.

    .venv/bin/python scripts/bench_security.py [--submits 300] [--gets 1000]

Needs ``cryptography`` (dev extra) for the throwaway certificates.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opentinker.common.v1 import common_pb2 as C  # noqa: E402
from opentinker.scheduler.v1 import admin_pb2 as A, admin_pb2_grpc, scheduler_pb2 as S, scheduler_pb2_grpc  # noqa: E402
from opentinker_scheduler.config import parse_config  # noqa: E402
from opentinker_scheduler.server import start_scheduler  # noqa: E402


def run_mode(name: str, config_text: str, base: Path, submits: int, gets: int, ca: Path | None) -> dict[str, float]:
    cfg = replace(parse_config(config_text, "bench.yaml", base_dir=base), state_dir=base / f"state-{name}")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(
        start_scheduler(cfg, host="127.0.0.1", port=0, http_port=None), loop
    ).result(60)
    target = f"localhost:{running.port}"
    try:
        channel = (
            grpc.secure_channel(target, grpc.ssl_channel_credentials(ca.read_bytes()))
            if ca
            else grpc.insecure_channel(target)
        )
        md = None
        key_file = cfg.state_dir / "admin.key"
        if key_file.exists():
            admin = key_file.read_text().strip()
            user = admin_pb2_grpc.AdminServiceStub(channel).CreateApiKey(
                A.CreateApiKeyRequest(owner="bench", role=A.API_KEY_ROLE_USER),
                metadata=(("authorization", f"Bearer {admin}"),),
            )
            md = (("authorization", f"Bearer {user.api_key}"),)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m", resources=C.Resources(gpu_count=0))
        stub.GetTask(
            S.GetTaskRequest(task_id=stub.SubmitTask(S.SubmitTaskRequest(spec=spec), metadata=md).task.task_id),
            metadata=md,
        )  # warm up
        t0 = time.perf_counter()
        ids = [stub.SubmitTask(S.SubmitTaskRequest(spec=spec), metadata=md).task.task_id for _ in range(submits)]
        t1 = time.perf_counter()
        for i in range(gets):
            stub.GetTask(S.GetTaskRequest(task_id=ids[i % len(ids)]), metadata=md)
        t2 = time.perf_counter()
        channel.close()
        return {"submit_us": (t1 - t0) / submits * 1e6, "get_us": (t2 - t1) / gets * 1e6}
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--submits", type=int, default=300)
    p.add_argument("--gets", type=int, default=1000)
    args = p.parse_args()
    from opentinker_common.logs import configure_logging

    configure_logging(level="warning")  # one log line per submit would drown the table
    sys.path.insert(0, str(ROOT / "tests"))
    from tests.support.security import make_certs

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        certs = make_certs(base / "certs")
        # specs name /models/m
        unlimited = "limits: {submit_rate: 0, max_pending_per_owner: 0}\npaths: {model_dirs: [/models]}\n"
        modes = [
            ("off", "", None),
            ("keys", "auth: {enabled: true}\n" + unlimited, None),
            (
                "keys+tls",
                "auth: {enabled: true}\n" + unlimited + "tls: {cert: certs/server.pem, key: certs/server.key}\n",
                certs.ca,
            ),
        ]
        results = {name: run_mode(name, text, base, args.submits, args.gets, ca) for name, text, ca in modes}
    base_r = results["off"]
    print(f"{'mode':10} {'SubmitTask us':>14} {'ratio':>6} {'GetTask us':>11} {'ratio':>6}")
    for name, r in results.items():
        print(
            f"{name:10} {r['submit_us']:14.0f} {r['submit_us'] / base_r['submit_us']:6.2f} "
            f"{r['get_us']:11.0f} {r['get_us'] / base_r['get_us']:6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
