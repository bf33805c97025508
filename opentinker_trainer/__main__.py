"""``python -m opentinker_trainer``: a trainer node. Reads ``SCHEDULER_URL`` (the seed's
``http://scheduler-host:8888`` or plain ``host:port``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import structlog

from opentinker_client.logs import configure_logging
from opentinker_client.url import parse_scheduler_url

from .agent import AgentConfig, FatalRegistrationError, NodeAgent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opentinker-trainer", description="OpenTinker trainer node agent.")
    parser.add_argument("--scheduler-url", default=os.environ.get("SCHEDULER_URL", "localhost:8888"), help="default: env SCHEDULER_URL, else localhost:8888")
    parser.add_argument("--node-id", default=os.environ.get("NODE_ID") or socket.gethostname(), help="default: env NODE_ID, else the host name")
    parser.add_argument("--max-tasks", type=int, default=int(os.environ.get("MAX_TASKS", "4")))
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("OPENTINKER_WORK_DIR", "runs")), help="checkpoints and worker files (default: ./runs)")
    parser.add_argument("--simulate-gpus", type=int, default=0, metavar="N", help="pretend to have N GPUs (tests and scale runs; marked simulated everywhere)")
    parser.add_argument("--kill-grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL of a cancelled worker")
    args = parser.parse_args(argv)
    configure_logging()
    log = structlog.get_logger("opentinker.trainer")
    try:
        target = parse_scheduler_url(args.scheduler_url)
    except ValueError as exc:
        print(f"error: SCHEDULER_URL: {exc}", file=sys.stderr)
        return 2
    if args.max_tasks < 1 or args.simulate_gpus < 0:
        print("error: --max-tasks must be >= 1 and --simulate-gpus >= 0", file=sys.stderr)
        return 2
    config = AgentConfig(
        target=target,
        node_id=args.node_id,
        max_tasks=args.max_tasks,
        work_dir=args.work_dir.resolve(),
        simulate_gpus=args.simulate_gpus,
        kill_grace_s=args.kill_grace,
    )

    async def run() -> int:
        agent = NodeAgent(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: asyncio.ensure_future(agent.drain(signal.Signals(s).name)))
        try:
            await agent.run()
        except FatalRegistrationError as exc:
            log.error("scheduler refused this node", error=str(exc))
            await agent.stop_now()
            return 1
        finally:
            agent.monitor.close()
        return 0

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
