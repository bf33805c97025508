"""``python -m opentinker_trainer``: a trainer node. Reads ``SCHEDULER_URL`` (the seed's
``http://scheduler-host:8888`` or plain ``host:port``; ``https://host:port`` for TLS, with
``--tls-ca`` or else the system roots)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import socket
import sys
from pathlib import Path

import structlog

from opentinker_common.logs import configure_logging
from opentinker_common.net.leader import parse_scheduler_urls

from opentinker_trainer.agent import AgentConfig, FatalRegistrationError, NodeAgent

#: Tenants per model host when ``--tenants-per-host`` is given without a number.
DEFAULT_TENANTS_PER_HOST = 8


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535 (0 = any free port), got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


# Options whose default comes from the environment: (dest, variable, type, default).
# SCHEDULER_URL, NODE_ID and OPENTINKER_WORK_DIR are read (and checked) in main().
_ENV_OPTIONS = (
    ("max_tasks", "MAX_TASKS", _int_at_least(1), 4),
    ("http_port", "OPENTINKER_HTTP_PORT", _port, None),  # None = no HTTP port
)


def _http_tls_context(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The HTTPS context of the HTTP port from --http-tls-cert/--http-tls-key (or their
    environment variables), else None; a bad pair is a one-line error (exit 2)."""
    for dest, var in (
        ("http_tls_cert", "OPENTINKER_HTTP_TLS_CERT"),
        ("http_tls_key", "OPENTINKER_HTTP_TLS_KEY"),
        ("http_tls_client_ca", "OPENTINKER_HTTP_TLS_CLIENT_CA"),
    ):
        if getattr(args, dest) is None:
            setattr(args, dest, os.environ.get(var) or "")
    if not args.http_tls_cert and not args.http_tls_key:
        return None
    if bool(args.http_tls_cert) != bool(args.http_tls_key):
        parser.error("--http-tls-cert and --http-tls-key: expected both (HTTPS) or neither")
    if args.http_port is None:
        parser.error(
            "--http-tls-cert: expected --http-port (or OPENTINKER_HTTP_PORT) too; there is no HTTP port to secure"
        )
    import ssl

    from opentinker_common.net.tls import check_pem_path, server_ssl_context

    try:
        context = server_ssl_context(args.http_tls_cert, args.http_tls_key, names=("--http-tls-cert", "--http-tls-key"))
    except (OSError, ssl.SSLError, ValueError) as exc:  # ValueError: not a regular file, over 1 MiB, encrypted key
        parser.error(
            "--http-tls-cert/--http-tls-key: expected a readable PEM certificate and its key, "
            f"got {args.http_tls_cert!r} and {args.http_tls_key!r} "
            f"({getattr(exc, 'strerror', None) or getattr(exc, 'reason', None) or exc})"
        )
    if args.http_tls_client_ca:  # mTLS: only scrapers (and probes) with a certificate this CA signed
        try:
            check_pem_path(args.http_tls_client_ca, "--http-tls-client-ca")
            context.load_verify_locations(cafile=args.http_tls_client_ca)
        except (OSError, ssl.SSLError, ValueError) as exc:
            parser.error(
                f"--http-tls-client-ca: expected a readable PEM CA certificate, got {args.http_tls_client_ca!r} "
                f"({getattr(exc, 'strerror', None) or getattr(exc, 'reason', None) or exc})"
            )
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _http_scrape_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str | None, bool]:
    """``(scrape token or None, task labels on)`` from --http-metrics-token-file and
    --http-no-task-labels (or their environment variables); a bad file is a one-line error."""
    if args.http_metrics_token_file is None:
        args.http_metrics_token_file = os.environ.get("OPENTINKER_HTTP_METRICS_TOKEN_FILE") or ""
    hide = args.http_no_task_labels or (os.environ.get("OPENTINKER_HTTP_TASK_LABELS") or "").lower() in (
        "0",
        "off",
        "false",
        "no",
    )
    token = None
    if args.http_metrics_token_file:
        if args.http_port is None:
            parser.error("--http-metrics-token-file: expected --http-port (or OPENTINKER_HTTP_PORT) too")
        from opentinker_common.net.side_port import read_scrape_token

        try:
            token = read_scrape_token(args.http_metrics_token_file, "--http-metrics-token-file")
        except ValueError as exc:
            parser.error(str(exc))
    return token, not hide


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog or "opentinker-trainer", description="OpenTinker trainer node agent.")
    parser.add_argument(
        "--scheduler-url",
        default=None,
        help="default: env SCHEDULER_URL, else localhost:8888; several schedulers: host-a:8888,host-b:8888",
    )
    parser.add_argument("--node-id", default=None, help="default: env NODE_ID, else the host name")
    parser.add_argument(
        "--max-tasks", type=_int_at_least(1), default=None, help="tasks at once (default: env MAX_TASKS, else 4)"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="checkpoints and worker files (default: env OPENTINKER_WORK_DIR, else ./runs)",
    )
    parser.add_argument(
        "--simulate-gpus",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="pretend to have N GPUs (tests and scale runs; marked simulated everywhere)",
    )
    parser.add_argument(
        "--simulate-gpu-memory",
        type=_int_at_least(1),
        default=80,
        metavar="GIB",
        help="memory of each simulated GPU in GiB, what the scheduler places shared LoRA tenants "
        "against (default %(default)s)",
    )
    parser.add_argument(
        "--node-class",
        default=None,
        help="the node's class for the scheduler's prices per GPU-hour and scale signal, e.g. spot "
        "(default: env NODE_CLASS, else the scheduler's usage.default_node_class)",
    )
    parser.add_argument(
        "--kill-grace",
        type=_seconds,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL of a cancelled worker (an exit checkpoint being stored is awaited)",
    )
    parser.add_argument(
        "--tenants-per-host",
        type=_int_at_least(0),
        nargs="?",
        const=DEFAULT_TENANTS_PER_HOST,
        default=0,
        metavar="N",
        help="run shareable LoRA tasks (lora_finetune on text) on the same base model and GPUs as tenants of one "
        "model host process holding one copy of the base, at most N per host (the flag alone: "
        f"{DEFAULT_TENANTS_PER_HOST}); the scheduler also places them by its GPU memory estimate; 0 = off, a "
        "worker process per task (default %(default)s)",
    )
    parser.add_argument(
        "--host-idle",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="seconds a model host with no tenants waits for a new one before it exits (default %(default)s)",
    )
    parser.add_argument(
        "--http-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve GET /health, /live and /metrics (Prometheus) on this port; 0 = any free port "
        "(default: env OPENTINKER_HTTP_PORT, else no HTTP port)",
    )
    parser.add_argument("--http-host", default="0.0.0.0", help="address the HTTP port listens on (default %(default)s)")
    parser.add_argument(
        "--advertise-host",
        default=os.environ.get("OPENTINKER_ADVERTISE_HOST") or "",
        help="host name clients dial for servers this node runs (inference tasks); "
        "default: env OPENTINKER_ADVERTISE_HOST, "
        "else 127.0.0.1 when the scheduler is on loopback, else this machine's host name",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="API key with the node role (default: env OPENTINKER_API_KEY, preferred: other local users can read "
        "arguments in ps; none when the scheduler has auth off)",
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA of the scheduler's certificate; turns TLS on (default: env OPENTINKER_TLS_CA)",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="PEM client certificate for mTLS (default: env OPENTINKER_TLS_CERT)"
    )
    parser.add_argument("--tls-key", default=None, help="PEM key of --tls-cert (default: env OPENTINKER_TLS_KEY)")
    parser.add_argument(
        "--http-tls-cert",
        default=None,
        metavar="PEM",
        help="serve the HTTP port as HTTPS with this certificate chain (default: env OPENTINKER_HTTP_TLS_CERT)",
    )
    parser.add_argument(
        "--http-tls-key",
        default=None,
        metavar="PEM",
        help="PEM key of --http-tls-cert (default: env OPENTINKER_HTTP_TLS_KEY)",
    )
    parser.add_argument(
        "--http-tls-client-ca",
        default=None,
        metavar="PEM",
        help="with --http-tls-cert: answer only clients whose certificate this CA signed (mTLS, probes included; "
        "default: env OPENTINKER_HTTP_TLS_CLIENT_CA)",
    )
    parser.add_argument(
        "--http-metrics-token-file",
        default=None,
        metavar="FILE",
        help="answer /metrics only with 'Authorization: Bearer <the token in FILE>' (Prometheus: "
        "authorization.credentials_file); /health and /live stay open (default: env "
        "OPENTINKER_HTTP_METRICS_TOKEN_FILE)",
    )
    parser.add_argument(
        "--http-no-task-labels",
        action="store_true",
        help="leave the per-task series (task ids with step, reward, loss) out of /metrics "
        "(or env OPENTINKER_HTTP_TASK_LABELS=off)",
    )
    parser.add_argument(
        "--serve-tls-cert",
        default=os.environ.get("OPENTINKER_SERVE_TLS_CERT") or "",
        help="PEM certificate of this node's inference servers; with --serve-tls-key they speak TLS and report "
        "https://host:port "
        "(default: env OPENTINKER_SERVE_TLS_CERT)",
    )
    parser.add_argument(
        "--serve-tls-key",
        default=os.environ.get("OPENTINKER_SERVE_TLS_KEY") or "",
        help="PEM key of --serve-tls-cert (default: env OPENTINKER_SERVE_TLS_KEY)",
    )
    args = parser.parse_args(argv)
    os.umask(
        0o077
    )  # what the node and its workers write (checkpoints, assignment files with tokens) is this user's only
    api_key_from = "--api-key" if args.api_key is not None else "environment variable OPENTINKER_API_KEY"
    for dest, var in (
        ("api_key", "OPENTINKER_API_KEY"),
        ("tls_ca", "OPENTINKER_TLS_CA"),
        ("tls_cert", "OPENTINKER_TLS_CERT"),
        ("tls_key", "OPENTINKER_TLS_KEY"),
    ):
        if getattr(args, dest) is None:
            setattr(args, dest, os.environ.get(var) or "")
    from opentinker_common.net.bearer import clean_api_key

    try:  # a key read from a file ends in "\n": stripped; inner whitespace is a one-line error (never the key)
        args.api_key = clean_api_key(args.api_key, api_key_from)
    except ValueError as exc:
        parser.error(str(exc))
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key: expected both (mTLS) or neither")
    from opentinker_common.net.tls import check_key_pair, check_pem_path

    try:  # a key of another certificate would retry forever with "Invalid private key": one line, exit 2
        if args.tls_cert:
            check_key_pair(args.tls_cert, args.tls_key, names=("--tls-cert", "--tls-key"))
        for flag, path in (("--serve-tls-cert", args.serve_tls_cert), ("--serve-tls-key", args.serve_tls_key)):
            if path:  # regular files of at most 1 MiB (not /dev/zero, not a FIFO) before anything reads them
                check_pem_path(path, flag)
    except ValueError as exc:
        parser.error(str(exc))
    from opentinker_trainer.inference.serve_tls import read_server_tls  # torch-free

    try:  # inference servers' TLS: both or neither, readable PEM, checked now (one line, exit 2)
        read_server_tls(args.serve_tls_cert, args.serve_tls_key)
    except ValueError as exc:
        parser.error(str(exc))
    if args.serve_tls_cert:  # a key of another certificate: gRPC would refuse it only when a task binds its port
        import ssl

        from opentinker_common.net.tls import server_ssl_context

        try:
            server_ssl_context(args.serve_tls_cert, args.serve_tls_key, names=("--serve-tls-cert", "--serve-tls-key"))
        except (OSError, ssl.SSLError, ValueError) as exc:
            why = (
                "the key does not match the certificate"
                if "KEY_VALUES_MISMATCH" in str(exc)
                else (getattr(exc, "reason", None) or exc)
            )
            parser.error(f"--serve-tls-cert/--serve-tls-key: {why} ({args.serve_tls_cert!r}, {args.serve_tls_key!r})")
    # Workers may run in another directory: hand them absolute paths.
    args.serve_tls_cert = str(Path(args.serve_tls_cert).resolve()) if args.serve_tls_cert else ""
    args.serve_tls_key = str(Path(args.serve_tls_key).resolve()) if args.serve_tls_key else ""
    # Environment defaults are checked like the options, with an argparse-style one-line error
    # naming the variable (exit 2), never a traceback.
    for dest, var, kind, default in _ENV_OPTIONS:
        if getattr(args, dest) is not None:
            continue
        text = os.environ.get(var) or None  # empty counts as unset
        try:
            setattr(args, dest, default if text is None else kind(text))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"environment variable {var}: {exc}")
    url_from = "--scheduler-url" if args.scheduler_url is not None else "environment variable SCHEDULER_URL"
    if args.scheduler_url is None:
        args.scheduler_url = os.environ.get("SCHEDULER_URL", "localhost:8888")
    if args.node_id is None:
        args.node_id = os.environ.get("NODE_ID") or socket.gethostname()
    if not args.node_id.strip():
        parser.error("--node-id: expected a non-empty node id")
    if args.work_dir is None:
        args.work_dir = Path(os.environ.get("OPENTINKER_WORK_DIR") or "runs")
    try:
        # One URL, or several schedulers' separated by commas (the node follows their leader).
        addresses = parse_scheduler_urls(args.scheduler_url)  # https:// / grpcs://: TLS even without --tls-ca
    except ValueError as exc:
        parser.error(f"{url_from}: {exc}")
    address = addresses[0]
    target = address.target
    if args.tls_cert and not args.tls_ca and not address.tls:
        parser.error(
            "--tls-ca: expected the scheduler's CA when a client certificate is given "
            "(or an https:// scheduler URL to trust the system roots)"
        )
    http_tls = _http_tls_context(parser, args)
    scrape_token, task_labels = _http_scrape_options(parser, args)
    configure_logging()
    log = structlog.get_logger("opentinker.trainer")
    config = AgentConfig(
        target=target,
        targets=tuple(a.target for a in addresses),
        node_id=args.node_id,
        max_tasks=args.max_tasks,
        work_dir=args.work_dir.resolve(),
        simulate_gpus=args.simulate_gpus,
        simulate_gpu_memory_bytes=args.simulate_gpu_memory * 1024**3,
        kill_grace_s=args.kill_grace,
        tenants_per_host=args.tenants_per_host,
        host_idle_s=args.host_idle,
        advertise_host=args.advertise_host,
        api_key=args.api_key,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        scheduler_tls=address.tls,
        serve_tls_cert=args.serve_tls_cert,
        serve_tls_key=args.serve_tls_key,
        node_class=args.node_class if args.node_class is not None else os.environ.get("NODE_CLASS", ""),
    )
    if args.tls_ca or address.tls:
        from opentinker_common.net.tls import channel_credentials

        try:
            channel_credentials(
                args.tls_ca, args.tls_cert, args.tls_key, tls=address.tls
            )  # bad files: a one-line error, not a retry loop
        except ValueError as exc:
            parser.error(str(exc))

    async def run() -> int:
        agent = NodeAgent(config)
        http = None
        if args.http_port is not None:  # /health, /live, /metrics (opentinker_trainer/http.py)
            from opentinker_trainer.http import TrainerHttp

            try:
                http = TrainerHttp(
                    agent,
                    args.http_host,
                    args.http_port,
                    ssl_context=http_tls,
                    scrape_token=scrape_token,
                    task_labels=task_labels,
                )
            except (OSError, OverflowError) as exc:
                agent.monitor.close()
                print(
                    f"error: cannot listen on HTTP port {args.http_host}:{args.http_port}: "
                    f"{getattr(exc, 'strerror', None) or exc}",
                    file=sys.stderr,
                )
                return 1
            http.start()
            log.info("trainer http listening", http_port=http.port, node_id=config.node_id, scheme=http.scheme)
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
            if http is not None:
                http.stop()
            agent.monitor.close()
        return 0

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
