"""``python -m opentinker_gateway --scheduler HOST:PORT --port N``: serve the Tinker API, with the
Tinker model names of the scheduler's ``model_names:`` table, until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import structlog

from opentinker_common.logs import configure_logging
from opentinker_gateway.app import GatewayConfig
from opentinker_gateway.download_urls import DownloadUrls
from opentinker_gateway.server import GatewayServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opentinker_gateway", description=__doc__)
    parser.add_argument("--scheduler", required=True, help="the scheduler, HOST:PORT or http(s)://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--max-body-mb", type=float, default=256.0, help="largest request body, decompressed (MiB)")
    parser.add_argument(
        "--gap-timeout-s", type=float, default=60.0, help="seconds a request waits for a missing earlier seq_id"
    )
    parser.add_argument(
        "--answer-wait-s",
        type=float,
        default=20.0,
        help="seconds a training request waits for its answer before a 408, which the SDK answers by "
        "sending it again (default 20, below the SDK's 60 s read timeout)",
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=300.0,
        help="a model ends after this many seconds without a request or a heartbeat of its session",
    )
    parser.add_argument(
        "--download-url-secret-file",
        type=Path,
        help="a file of at least 32 bytes of secret; gateways given the same file serve each other's "
        "checkpoint download URLs (default: a random secret, URLs served by this instance only)",
    )
    args = parser.parse_args(argv)
    if args.download_url_secret_file is not None:
        try:
            DownloadUrls.from_file(args.download_url_secret_file)
        except ValueError as exc:
            parser.error(str(exc))
    config = GatewayConfig(
        scheduler=args.scheduler,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        gap_timeout_s=args.gap_timeout_s,
        answer_wait_s=args.answer_wait_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        download_url_secret_file=args.download_url_secret_file,
    )
    configure_logging()
    structlog.get_logger("opentinker.gateway").info(
        "gateway starting",
        address=f"{args.host}:{args.port}",
        scheduler=args.scheduler,
        gap_timeout_s=config.gap_timeout_s,
    )
    try:
        server = GatewayServer(config, args.host, args.port)
    except OSError as exc:
        parser.error(f"--port: cannot listen on {args.host}:{args.port}: {exc}")
    asyncio.run(_serve(server))
    return 0


async def _serve(server: GatewayServer) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    await server.serve()


if __name__ == "__main__":
    sys.exit(main())
