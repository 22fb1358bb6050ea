"""The served TLS certificate's expiry, as seconds left at scrape time.

The TLS layer (service/edge/tls.py) reports the notAfter of the certificate it serves, at
start and at every reload; the gauge is computed when scraped, so it falls by itself between
reloads and turns negative once the certificate has expired. Every worker serves the same
files (each reloads them within a second), so the worker answering the scrape speaks for all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from service.metrics import definitions as names

_not_after: float | None = None


def served(not_after: float | None) -> None:
    """The served certificate's notAfter (seconds since the epoch); None: no TLS."""
    global _not_after
    _not_after = not_after


class CertificateCollector:
    """Yields the expiry gauge when this process serves a certificate, nothing otherwise."""

    def collect(self) -> Iterator[Metric]:
        not_after = _not_after
        if not_after is None:
            return
        yield GaugeMetricFamily(
            names.TLS_CERTIFICATE_EXPIRY,
            "Seconds until the served TLS certificate's notAfter (negative: expired).",
            value=not_after - time.time(),
        )
