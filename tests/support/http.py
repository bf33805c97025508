"""Reading the HTTP ports in tests: one GET that returns the status of an error response too, and
Prometheus text parsed with prometheus-client's own parser."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def http_get(url: str, context: ssl.SSLContext | None = None, timeout: float = 10) -> tuple[int, bytes]:
    """(status, body) of ``GET url``; a 4xx/5xx answer is returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def metric_samples(text: str) -> dict[str, list]:
    """name -> [(labels, value)] of every sample in a /metrics body."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def metric_value(metrics: dict, name: str, **labels) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels`` (None when none)."""
    for got, v in metrics.get(name, []):
        if all(got.get(k) == str(x) for k, x in labels.items()):
            return v
    return None
