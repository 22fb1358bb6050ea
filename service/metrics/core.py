"""The service's metrics: what the application, the auth layer and the executors call.

The request path is kept small: label children are created once per label set and cached in a
dict keyed by a tuple, so a request (or an inline crypto operation) costs a dict lookup and a
tuple appended to a queue that is applied to the histograms and the latency window once per
event-loop iteration (batch.py). The request and operation counters are derived from the
histograms' counts at scrape time.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.util
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from service.metrics import definitions, multiproc
from service.metrics.batch import LoopBatch
from service.metrics.certificate import CertificateCollector
from service.metrics.exposition import ScrapeTimeCollector, Totals, render_directory
from service.metrics.labels import OTHER, KeyLabels
from service.metrics.process import ProcessCollector, register_process
from service.metrics.window import DEFAULT_SLOTS, SeriesKey, SlidingWindow, merge

log = logging.getLogger("cryptd.metrics")

# The auth middleware reports its 429 as "rate_limited"; one name per cause on the dashboards.
_CAUSES = {"rate_limited": "rate_limit"}

_RequestSeries = tuple[Any, SeriesKey]  # histogram child, window series
_CryptoSeries = tuple[Any, SeriesKey]  # histogram child, window series


class Metrics:
    """Records cryptd's metrics in this process and renders the service-wide exposition.

    ``multiprocess_dir`` (default: ``PROMETHEUS_MULTIPROC_DIR`` when set) switches on
    prometheus-client's multiprocess mode: every process writes its own files there and
    :meth:`render` merges all of them. It is needed as soon as more than one process serves or
    computes (several uvicorn workers, or a process pool whose workers call
    :meth:`observe_crypto`). A Metrics pickles as its configuration, so a pool initializer
    receiving ``metrics.observe_crypto`` gets a process-local instance writing its own files.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        window_seconds: float = 60.0,
        multiprocess_dir: Path | None = None,
        publish_interval: float = 1.0,
        max_keys: int = 100,
    ) -> None:
        """``max_keys``: keys labelled in ``cryptd_key_operations_total`` (labels.py)."""
        self.enabled = enabled
        self.max_keys = max_keys
        self.window_seconds = window_seconds
        directory = multiprocess_dir if multiprocess_dir is not None else multiproc.env_dir()
        self.multiprocess_dir = directory if enabled else None
        self._window = SlidingWindow(window_seconds, DEFAULT_SLOTS)
        self._registry = CollectorRegistry(auto_describe=False)
        self._publisher: multiproc.WindowPublisher | None = None
        self._http: dict[tuple[str, str, int], _RequestSeries] = {}
        self._crypto: dict[tuple[str, str, str], _CryptoSeries] = {}
        self._children: dict[tuple[str, str], Any] = {}
        self._series_lock = threading.Lock()
        self._batch = LoopBatch(self._window)
        self._key_labels = KeyLabels(max_keys, self.multiprocess_dir)
        if not enabled:
            return
        if self.multiprocess_dir is not None:
            multiproc.activate(self.multiprocess_dir)
            self._publisher = multiproc.WindowPublisher(
                self._window, self.multiprocess_dir, publish_interval
            )
        elif multiproc.is_multiprocess():
            raise ValueError(f"{multiproc.ENV_VAR} was set when prometheus-client was imported")
        # The *_created series double the exposition and multiprocess mode cannot produce them;
        # leaving them out keeps single- and multi-process output alike.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self._families = definitions.create_families(None)
        if self.multiprocess_dir is None:
            for field in dataclasses.fields(self._families):
                family = getattr(self._families, field.name)
                if isinstance(family, Histogram):
                    self._registry.register(Totals(family))
                else:
                    self._registry.register(family)
            self._registry.register(ScrapeTimeCollector(self._local_windows, window_seconds))
            self._registry.register(ProcessCollector(lambda: [os.getpid()]))
            self._registry.register(CertificateCollector())
        else:
            register_process(self.multiprocess_dir)
            _close_at_exit(self)
        _forget_parent_after_fork(self)

    def __reduce__(self) -> tuple[Any, tuple[bool, float, Path | None, int]]:
        return (
            _process_instance,
            (self.enabled, self.window_seconds, self.multiprocess_dir, self.max_keys),
        )

    # -- the request path -------------------------------------------------------------------

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        if method not in definitions.HTTP_METHODS:
            method = "other"  # the method is client input: keep the label set bounded
        key = (route, method, status)
        series = self._http.get(key)
        if series is None:
            series = self._request_series(key)
        self._batch.observe(series[0], series[1], seconds)
        publisher = self._publisher
        if publisher is not None and not publisher.started:
            publisher.start()

    def observe_crypto(
        self,
        operation: str,
        key_type: str,
        seconds: float,
        outcome: str = "ok",
        items: int = 1,
    ) -> None:
        """Record ``items`` operations that took ``seconds`` together (a batch chunk counts each
        item once, at the chunk's mean time per item). Call it where the work ran."""
        if not self.enabled or items < 1:
            return
        key = (operation, key_type, outcome)
        series = self._crypto.get(key)
        if series is None:
            series = self._crypto_series(key)
        self._batch.observe(series[0], series[1], seconds / items, items)
        publisher = self._publisher
        if publisher is not None and not publisher.started:
            publisher.start()

    def auth_failure(self, reason: str) -> None:
        if self.enabled:
            self._child(self._families.auth_failures, reason).inc()

    def rejected(self, cause: str) -> None:
        """``cause``: "overload" (503, work queue full), "rate_limit" (429), "body_size" (413);
        "replay_unavailable" (503, replay store down) and "media_type" (415) where the auth
        layer reports them; "header_size" (431), "read_timeout" (408), "malformed_http" (400)
        from the server's protocol (service/edge/protocol.py)."""
        if self.enabled:
            self._child(self._families.rejections, _CAUSES.get(cause, cause)).inc()

    def pool_gauges(
        self,
        queued: int,
        in_flight: int,
        *,
        executor: str = "process",
        max_pending: int | None = None,
    ) -> None:
        if not self.enabled:
            return
        families = self._families
        self._child(families.pool_queued, executor).set(queued)
        self._child(families.pool_in_flight, executor).set(in_flight)
        if max_pending is not None:
            self._child(families.pool_max_pending, executor).set(max_pending)

    def queue_wait(self, seconds: float, *, executor: str = "process") -> None:
        if self.enabled:
            self._child(self._families.pool_queue_wait, executor).observe(seconds)

    def key_operations(self, counts: Mapping[tuple[str, str, int, str], int]) -> None:
        """Add usage counts ((key, key created_at, version, operation) -> count): called when
        they are flushed, never per request. Keys beyond the cap count as ``_other``."""
        if not self.enabled:
            return
        family = self._families.key_operations
        labelled = self._key_labels.labelled
        totals: dict[tuple[str, str, str], int] = {}
        for (name, _, version, operation), count in counts.items():
            if labelled(name):
                labels = (name, str(version), operation)
            else:
                labels = (OTHER, OTHER, operation)
            totals[labels] = totals.get(labels, 0) + count
        for labels, count in totals.items():
            family.labels(*labels).inc(count)

    def usage_flush(self, ok: bool) -> None:
        if self.enabled:
            self._child(self._families.usage_flushes, "ok" if ok else "error").inc()

    def audit_write_failures(self, lost: int) -> None:
        """``lost`` audit records not written (called from the audit writer's thread)."""
        if self.enabled:
            self._families.audit_write_failures.inc(lost)

    def key_change_propagated(self, seconds: float, complete: bool) -> None:
        if self.enabled:
            outcome = "confirmed" if complete else "incomplete"
            self._child(self._families.key_change_propagation, outcome).observe(seconds)

    def keyring_reload(self, ok: bool) -> None:
        if self.enabled:
            self._child(self._families.keyring_reloads, "ok" if ok else "error").inc()

    def store_up(self, store: str, up: bool) -> None:
        """Whether ``store`` ("key" or "replay") answered this process's last look."""
        if not self.enabled:
            return
        if store not in definitions.STORES:
            raise ValueError(f"unknown store {store!r}")
        self._child(self._families.store_up, store).set(1 if up else 0)

    def clock_offset(self, store: str, seconds: float) -> None:
        """This host's clock minus a reference's: ``replay`` (Redis TIME) or ``keystore`` (the
        PostgreSQL key store's server), as readiness measured it (a series exists from its first
        measurement on: never with the host or memory replay store, nor the file key store)."""
        if store not in definitions.CLOCK_REFERENCES:
            raise ValueError(f"unknown clock reference {store!r}")
        if self.enabled:
            self._child(self._families.clock_offset, store).set(seconds)

    # -- exposition -------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """Body and content type for ``GET /metrics``. In multiprocess mode this reads every
        process's files (milliseconds): call it off the event loop."""
        if not self.enabled:
            return b"", CONTENT_TYPE_LATEST
        self._batch.flush()
        if self.multiprocess_dir is not None:
            if self._publisher is not None and self._window.changed:
                self._publisher.publish()
            return render_directory(self.multiprocess_dir, window_seconds=self.window_seconds)
        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        """Apply queued observations, publish the last latency window and stop the publishing
        thread (at shutdown)."""
        self._batch.flush()
        if self._publisher is not None:
            self._publisher.stop()

    # -- internals --------------------------------------------------------------------------

    def _local_windows(self) -> dict[SeriesKey, Any]:
        return merge(
            [self._window.snapshot()],
            window_seconds=self.window_seconds,
            slots=DEFAULT_SLOTS,
            quantiles=definitions.QUANTILES,
        )

    def _request_series(self, key: tuple[str, str, int]) -> _RequestSeries:
        route, method, status = key
        families = self._families
        with self._series_lock:
            series = (
                families.http_duration.labels(route, method, str(status)),
                ("http", route, method),
            )
            self._http[key] = series
        return series

    def _crypto_series(self, key: tuple[str, str, str]) -> _CryptoSeries:
        operation, key_type, outcome = key
        families = self._families
        with self._series_lock:
            series = (
                families.crypto_duration.labels(operation, key_type, outcome),
                ("crypto", operation, key_type),
            )
            self._crypto[key] = series
        return series

    def _child(self, family: Any, value: str) -> Any:
        key = (family._name, value)
        child = self._children.get(key)
        if child is None:
            with self._series_lock:
                child = self._children[key] = family.labels(value)
        return child

    def _after_fork_in_child(self) -> None:
        # The child starts with its parent's memory: without this it would publish the
        # parent's window under its own pid and every parent observation would count twice.
        # (prometheus-client resets its own values when it sees the pid change.)
        self._window.reset()
        self._batch.reset()
        self._series_lock = threading.Lock()
        if self._publisher is not None:
            self._publisher.after_fork()
        if self.enabled and self.multiprocess_dir is not None:
            register_process(self.multiprocess_dir)


_instances: dict[tuple[int, bool, float, Path | None, int], Metrics] = {}
_instances_lock = threading.Lock()


def _process_instance(
    enabled: bool, window_seconds: float, directory: Path | None, max_keys: int = 100
) -> Metrics:
    """Unpickling target: one Metrics per configuration per process."""
    key = (os.getpid(), enabled, window_seconds, directory, max_keys)
    with _instances_lock:
        found = _instances.get(key)
        if found is None:
            found = _instances[key] = Metrics(
                enabled=enabled,
                window_seconds=window_seconds,
                multiprocess_dir=directory,
                max_keys=max_keys,
            )
    return found


def _close_at_exit(metrics: Metrics) -> None:
    """Publish the last window when the process ends normally. multiprocessing children (uvicorn
    workers, pool workers) skip atexit but run multiprocessing's own exit finalizers."""
    reference = weakref.ref(metrics)

    def close() -> None:
        found = reference()
        if found is not None:
            found.close()

    atexit.register(close)
    multiprocessing.util.Finalize(None, close, exitpriority=0)


def _forget_parent_after_fork(metrics: Metrics) -> None:
    reference = weakref.ref(metrics)

    def after_fork() -> None:
        found = reference()
        if found is not None:
            found._after_fork_in_child()

    os.register_at_fork(after_in_child=after_fork)
