"""Metrics computed at scrape time: build info and the sliding-window quantile gauges."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from service import __version__
from service.metrics import definitions as names
from service.metrics import multiproc
from service.metrics.certificate import CertificateCollector
from service.metrics.process import ProcessCollector, registered_processes
from service.metrics.window import DEFAULT_SLOTS, SeriesKey, SeriesWindow, merge

WindowSource = Callable[[], Mapping[SeriesKey, SeriesWindow]]


@cache
def build_labels() -> dict[str, str]:
    from cryptography.hazmat.backends.openssl.backend import backend

    return {
        "version": __version__,
        "python": platform.python_version(),
        "openssl": backend.openssl_version_text(),
    }


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class Totals:
    """Passes ``source``'s metrics through and adds the counters of DERIVED_TOTALS, read from
    their histogram's ``_count`` samples with the same labels."""

    def __init__(self, source: Collector) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for metric in self._source.collect():
            yield metric
            derived = names.DERIVED_TOTALS.get(metric.name)
            if derived is None:
                continue
            count_name = metric.name + "_count"
            samples = [sample for sample in metric.samples if sample.name == count_name]
            label_names = sorted(samples[0].labels) if samples else []
            totals = CounterMetricFamily(derived[0], derived[1], labels=label_names)
            for sample in samples:
                totals.add_metric([sample.labels[name] for name in label_names], sample.value)
            yield totals


class ScrapeTimeCollector:
    """Yields build info and, per series, the window's P50/P99 and observation count."""

    def __init__(self, windows: WindowSource, window_seconds: float) -> None:
        self._windows = windows
        self._window_seconds = window_seconds

    def collect(self) -> Iterator[Metric]:
        labels = build_labels()
        info = GaugeMetricFamily(
            names.BUILD_INFO, "cryptd build: version, Python and OpenSSL.", labels=list(labels)
        )
        info.add_metric(list(labels.values()), 1.0)
        yield info
        yield GaugeMetricFamily(
            names.WINDOW_SECONDS,
            "Length of the sliding window behind the *_window_* quantile gauges.",
            value=self._window_seconds,
        )
        http_q, http_n = _window_families(
            names.HTTP_WINDOW, names.HTTP_WINDOW_COUNT, "HTTP", "HTTP requests", ("route", "method")
        )
        crypto_q, crypto_n = _window_families(
            names.CRYPTO_WINDOW,
            names.CRYPTO_WINDOW_COUNT,
            "Per-operation",
            "Cryptographic operations",
            ("operation", "key_type"),
        )
        for (family, first, second), summary in sorted(self._windows().items()):
            quantiles, counts = (http_q, http_n) if family == "http" else (crypto_q, crypto_n)
            counts.add_metric([first, second], summary.count)
            for q, value in summary.quantiles.items():
                quantiles.add_metric([first, second, _format_quantile(q)], value)
        yield from (http_q, http_n, crypto_q, crypto_n)


def _window_families(
    quantile_name: str, count_name: str, timed: str, counted: str, labels: tuple[str, str]
) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """A series' window quantiles (labelled by ``labels`` and the quantile) and its count."""
    quantiles = GaugeMetricFamily(
        quantile_name,
        f"{timed} latency quantiles over the sliding window, merged across processes (DDSketch,"
        " 1% relative accuracy).",
        labels=[*labels, "quantile"],
    )
    counts = GaugeMetricFamily(
        count_name,
        f"{counted} inside the sliding window behind the quantile gauges.",
        labels=list(labels),
    )
    return quantiles, counts


def _format_quantile(q: float) -> str:
    return repr(q)


def render_directory(path: Path, *, window_seconds: float = 60.0) -> tuple[bytes, str]:
    """The exposition of every process writing to ``path``: what ``Metrics.render()`` answers in
    multiprocess mode, usable from any process (a sidecar, a test) without activating it."""
    multiproc.reap_dead_processes(path, window_seconds)
    registry = CollectorRegistry(auto_describe=False)
    files = MultiProcessCollector(None, path=str(path))  # type: ignore[no-untyped-call]
    registry.register(Totals(files))

    def windows() -> Mapping[SeriesKey, SeriesWindow]:
        return merge(
            multiproc.read_windows(path),
            window_seconds=window_seconds,
            slots=DEFAULT_SLOTS,
            quantiles=names.QUANTILES,
        )

    registry.register(ScrapeTimeCollector(windows, window_seconds))
    registry.register(ProcessCollector(lambda: registered_processes(path)))
    registry.register(CertificateCollector())
    return generate_latest(registry), CONTENT_TYPE_LATEST
