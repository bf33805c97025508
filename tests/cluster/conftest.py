"""The multi-host test runs with ``make test-cluster``, not in ``make test``: it needs root and
takes the machine's network namespaces for minutes."""

import os
import shutil

import pytest


def pytest_collection_modifyitems(config, items):
    reason = None
    if os.environ.get("OPENTINKER_CLUSTER_TEST") != "1":
        reason = "the multi-host test runs with make test-cluster (OPENTINKER_CLUSTER_TEST=1)"
    elif os.geteuid() != 0:
        reason = "simulated hosts need root (network and mount namespaces)"
    elif not all(shutil.which(tool) for tool in ("ip", "nsenter", "unshare")):
        reason = "simulated hosts need ip (iproute2), nsenter and unshare (util-linux)"
    elif not (shutil.which("haproxy") or os.path.exists("/usr/sbin/haproxy")):
        reason = "haproxy is not installed (make test-deps installs it as root)"
    elif not os.path.exists("/usr/lib/postgresql/15/bin/postgres"):
        reason = "PostgreSQL 15 is not installed (make test-deps installs it as root)"
    if reason:
        for item in items:
            if "tests/cluster/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))
