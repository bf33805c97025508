#!/usr/bin/env python3
"""What the endpoint-token check costs an inference server, all in one process and one run.

A real scheduler with auth on (grpc.aio, SQLite) on loopback; a user key, an inference task and
an endpoint token the key got for it.

1. ``AccessChecker.check``: a cached decision against a scheduler round trip (AuthorizeEndpoint with
   the caller's token; TTL short enough that every call misses). Median over ``--calls``.
2. Unary ``Generate`` of 1 token on a tiny random Llama (the test model: hidden 64, 2 layers)
   through the real ``InferenceClient``: a server with the check (cached, default TTL) against
   the same server without it, and with TLS + check against plaintext without it; runs
   alternate, median over ``--calls``. The tiny model keeps model time small, so the ratio shows
   the service overhead, not the model.

Prints one line per figure with its ratio against the baseline of the same run; exit 0 always.
Usage: .venv/bin/python scripts/bench_inference_access.py [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def tiny_model(folder: Path) -> Path:
    from tests.support.models import save_tiny_llama

    return save_tiny_llama(folder, ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")


class Served:
    def __init__(self, model_dir: Path, *, access=None, task_id: str = "", tls=None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from opentinker_trainer.inference.runtime import ModelRuntime
        from opentinker_trainer.inference.server import start_inference_server

        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.runtime = ModelRuntime(
            model_name=str(model_dir), tokenizer=tok, model=model, stop_token_ids=[tok.eos_token_id]
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = start_inference_server(self.runtime, host="127.0.0.1", port=0, tls=tls, access=access, task_id=task_id)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(60)
        self.endpoint = f"{'https://localhost' if tls else '127.0.0.1'}:{self.server.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.runtime.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()

    from opentinker_client import InferenceClient, RLClient
    from opentinker_trainer.inference.access import AccessChecker
    from opentinker_trainer.inference.serve_tls import read_server_tls
    from tests.support.security import LoopbackScheduler, make_certs

    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        sched = LoopbackScheduler(tmp / "state", "auth: {enabled: true}\npaths: {model_dirs: [/models]}\n")
        try:
            admin = (sched.config.state_dir / "admin.key").read_text().strip()
            with RLClient(sched.target, api_key=admin) as root:
                _, key = root.keys.create("alice", "user")
            with RLClient(sched.target, api_key=key) as alice:
                task = alice.submit_task(workload_type="inference", model="/models/m")
                token = alice.endpoint_token(task).token
            md = (("authorization", f"Bearer {token}"),)

            async def checks(ttl: float) -> float:
                checker = AccessChecker(sched.target, env={}, ttl=ttl)
                await checker.check(md, task)  # warm the channel
                times = []
                for _ in range(args.calls):
                    if ttl < 1:
                        checker._cache.clear()  # every call asks the scheduler
                    t = time.perf_counter()
                    await checker.check(md, task)
                    times.append(time.perf_counter() - t)
                await checker.close()
                return statistics.median(times)

            cached = asyncio.run(checks(60))
            uncached = asyncio.run(checks(1e-3))
            print(
                f"access check, cached: {cached * 1e6:.1f} us; scheduler round "
                f"trip (AuthorizeEndpoint with the caller's token): {uncached * 1e3:.2f} ms; "
                f"ratio {uncached / cached:.0f}x"
            )

            certs = make_certs(tmp / "certs")
            model_dir = tiny_model(tmp / "tiny")
            plain = Served(model_dir)
            checked = Served(model_dir, access=AccessChecker(sched.target, env={}), task_id=task)
            secure = Served(
                model_dir,
                access=AccessChecker(sched.target, env={}),
                task_id=task,
                tls=read_server_tls(certs.server_cert, certs.server_key),
            )
            try:
                clients = {
                    "plain": InferenceClient(plain.endpoint, api_key=""),
                    "checked": InferenceClient(checked.endpoint, api_key=token),
                    "tls+checked": InferenceClient(secure.endpoint, api_key=token, root_certificates=certs.ca),
                }
                for c in clients.values():  # warm: channels, first check, first forward pass
                    c.generate("Hi", max_tokens=1, temperature=0, ignore_eos=True)
                times: dict[str, list[float]] = {name: [] for name in clients}
                for _ in range(args.calls):
                    for name, c in clients.items():
                        t = time.perf_counter()
                        c.generate("Hi", max_tokens=1, temperature=0, ignore_eos=True)
                        times[name].append(time.perf_counter() - t)
                base = statistics.median(times["plain"])
                for name in ("checked", "tls+checked"):
                    m = statistics.median(times[name])
                    print(
                        f"Generate 1 token, tiny model, {name} vs plaintext without check: "
                        f"{m * 1e3:.2f} ms vs {base * 1e3:.2f} ms, ratio {m / base:.2f}"
                    )
                for c in clients.values():
                    c.close()
            finally:
                for s in (plain, checked, secure):
                    s.close()
        finally:
            sched.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
