"""``python -m opentinker_scheduler --config scheduler_config.yaml --port 8888``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys

import structlog

from opentinker_common.logs import configure_logging
from opentinker_common.glibc_malloc import tune_malloc

from opentinker_scheduler.config import ConfigError, load_config, SchedulerConfig
from opentinker_scheduler.server import start_scheduler


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 0..65535 (0 = any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {value}")
    return value


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog or "opentinker-scheduler", description="OpenTinker scheduler: queue, placement, state."
    )
    parser.add_argument("--config", help="scheduler_config.yaml (seed form: resource_pool, workload_types)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=_port, default=8888, help="gRPC port (default 8888)")
    parser.add_argument(
        "--http-port", type=_port, default=None, help="HTTP port for /health and /metrics (default: --port + 1)"
    )
    parser.add_argument("--state-dir", default=None, help="overrides state_dir of the config")
    parser.add_argument(
        "--advertise-address",
        default=os.environ.get("OPENTINKER_ADVERTISE_ADDRESS") or None,
        help="host:port clients and trainers reach this scheduler at; followers name it as the leader's "
        "(several schedulers on PostgreSQL). Default: env OPENTINKER_ADVERTISE_ADDRESS, else this host's name "
        "and --port",
    )
    args = parser.parse_args(argv)
    # The database (API key hashes, env tokens in specs), uploaded datasets and the bootstrap
    # admin key are this user's only: files 0600, folders 0700.
    os.umask(0o077)
    tune_malloc(stream_buffers=True)  # artifact streams reuse their 1 MiB buffers, not fresh pages
    configure_logging()
    log = structlog.get_logger("opentinker.scheduler")
    try:
        config = load_config(args.config) if args.config else SchedulerConfig()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.state_dir:
        from dataclasses import replace
        from pathlib import Path

        config = replace(config, state_dir=Path(args.state_dir))
    if config.store.kind == "postgres":
        sys.setswitchinterval(0.001)  # the committer thread's COMMIT answer waits 1 ms, not 5, for the GIL
    http_port = args.http_port if args.http_port is not None else args.port + 1
    if http_port > 65535:
        parser.error(f"--http-port: --port + 1 is {http_port}; give --http-port explicitly")

    async def run() -> None:
        running = await start_scheduler(
            config, host=args.host, port=args.port, http_port=http_port, advertise_address=args.advertise_address
        )
        gc.collect()  # the start's garbage goes now, before what lives on is frozen
        gc.freeze()  # full collections then skip the start's long-lived objects and stall the loop less
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("scheduler stopping")
        await running.stop()

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
