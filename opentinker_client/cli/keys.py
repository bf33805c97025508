"""``opentinker keys create|list|revoke|rotate``: API key management from the command line.

::

    opentinker --api-key "$ADMIN_KEY" keys create alice --role user --description "alice's laptop"
    opentinker keys list [--owner alice] [--all]
    opentinker keys rotate otk_1a2b3c4d [--grace 3600]     # prints the new key; old one works --grace s more
    opentinker keys revoke otk_1a2b3c4d

``create`` and ``rotate`` print the new key alone on stdout (the only time it is shown), so
``KEY=$(opentinker keys create alice)`` works; the record goes to stderr.
"""

from __future__ import annotations

import argparse
import sys

from opentinker_client.cli.render import markup, safe_text
from opentinker_client.cli.tables import print_fitted
from opentinker_client.keys import ROLES, ApiKeyInfo


def _fmt(t) -> str:
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S") if t is not None else "-"


def _describe(info: ApiKeyInfo) -> str:
    state = "active" if info.active else ("revoked" if info.revoke_time else "expired")
    extra = f", expires {_fmt(info.expire_time)}" if info.expire_time and info.active else ""
    return safe_text(f"{info.prefix} owner={info.owner} role={info.role} {state}{extra}")


def _cmd_create(client, args: argparse.Namespace) -> int:
    info, key = client.keys.create(args.owner, args.role, description=args.description)
    print(f"created {_describe(info)}; the key is shown only now:", file=sys.stderr)
    print(safe_text(key))
    return 0


#: ``opentinker keys list`` columns (DESCRIPTION wraps at words); on a narrow terminal they move
#: under each row in ``_MOVE_ORDER``, PREFIX, OWNER, ROLE and STATE stay.
_COLUMNS = (
    ("PREFIX", False),
    ("OWNER", False),
    ("ROLE", False),
    ("STATE", False),
    ("CREATED", False),
    ("EXPIRES", False),
    ("REPLACED BY", False),
    ("DESCRIPTION", True),
)
_MOVE_ORDER = ("DESCRIPTION", "REPLACED BY", "EXPIRES", "CREATED")


def _cmd_list(client, args: argparse.Namespace) -> int:
    from rich.console import Console

    rows = []
    for k in client.keys.list(owner=args.owner, include_inactive=args.all):
        state = "active" if k.active else ("revoked" if k.revoke_time else "expired")
        rows.append(
            (
                markup(k.prefix),
                markup(k.owner),
                markup(k.role),
                state,
                _fmt(k.create_time),
                _fmt(k.expire_time),
                markup(k.replaced_by) or "-",
                markup(k.description) or "-",
            )
        )
    print_fitted(
        Console(width=None if sys.stdout.isatty() else 200, emoji=False),
        _COLUMNS,
        rows,
        _MOVE_ORDER,
        unlabelled=frozenset({"DESCRIPTION"}),
    )
    return 0


def _cmd_revoke(client, args: argparse.Namespace) -> int:
    print(f"revoked {_describe(client.keys.revoke(args.prefix))}")
    return 0


def _cmd_rotate(client, args: argparse.Namespace) -> int:
    new, key, old = client.keys.rotate(args.prefix, grace=args.grace)
    print(
        f"rotated {old.prefix} -> {_describe(new)}; old key: {_describe(old)}; the new key is shown only now:",
        file=sys.stderr,
    )
    print(safe_text(key))
    return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 30 * 86400:
        raise argparse.ArgumentTypeError(f"expected seconds in [0, 2592000], got {text!r}")
    return value


def add_keys_parser(sub) -> None:
    """Add ``keys`` with its sub-commands to the ``opentinker`` sub-parsers."""
    keys = sub.add_parser("keys", help="API keys: create, list, revoke, rotate (see docs/security.md)")
    ks = keys.add_subparsers(dest="keys_command", required=True, metavar="KEYS_COMMAND")

    p = ks.add_parser("create", help="create a key (admin key needed); prints it once")
    p.add_argument("owner", help="who the key acts for (1..128 of letters, digits, ._@-)")
    p.add_argument("--role", choices=ROLES, default="user", help="default: %(default)s")
    p.add_argument("--description", default="", help="free text, at most 256 characters")
    p.set_defaults(func=_cmd_create)

    p = ks.add_parser("list", help="list keys by prefix (user keys see their own)")
    p.add_argument("--owner", default="", help="only this owner's keys (admins)")
    p.add_argument("--all", action="store_true", help="also revoked and expired keys")
    p.set_defaults(func=_cmd_list)

    p = ks.add_parser("revoke", help="revoke a key now")
    p.add_argument("prefix", metavar="PREFIX", help="otk_xxxxxxxx (or the whole key)")
    p.set_defaults(func=_cmd_revoke)

    p = ks.add_parser("rotate", help="replace a key with a new one; prints the new key once")
    p.add_argument("prefix", metavar="PREFIX", help="otk_xxxxxxxx (or the whole key)")
    p.add_argument(
        "--grace", type=_seconds, default=0.0, help="seconds the old key keeps working (default 0: stops now)"
    )
    p.set_defaults(func=_cmd_rotate)
