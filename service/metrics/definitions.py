"""Every metric cryptd exports: names, labels, buckets and multiprocess modes, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Roughly log-spaced (1-2-5) from 50 us to 5 s: the median request is well under a millisecond
# and the P99 under load is tens of milliseconds, so most resolution sits between the two.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.0002, 0.0005,
    0.001, 0.002, 0.005,
    0.01, 0.02, 0.05,
    0.1, 0.2, 0.5,
    1.0, 2.0, 5.0,
)  # fmt: skip

QUANTILES: tuple[float, ...] = (0.5, 0.99)

HTTP_REQUESTS = "cryptd_http_requests"  # exported as cryptd_http_requests_total
HTTP_DURATION = "cryptd_http_request_duration_seconds"
HTTP_WINDOW = "cryptd_http_request_duration_window_seconds"
HTTP_WINDOW_COUNT = "cryptd_http_request_window_observations"
CRYPTO_OPERATIONS = "cryptd_crypto_operations"
CRYPTO_DURATION = "cryptd_crypto_operation_duration_seconds"
CRYPTO_WINDOW = "cryptd_crypto_operation_duration_window_seconds"
CRYPTO_WINDOW_COUNT = "cryptd_crypto_operation_window_observations"
POOL_QUEUED = "cryptd_pool_queued"
POOL_IN_FLIGHT = "cryptd_pool_in_flight"
POOL_MAX_PENDING = "cryptd_pool_max_pending"
POOL_QUEUE_WAIT = "cryptd_pool_queue_wait_seconds"
AUTH_FAILURES = "cryptd_auth_failures"
REJECTIONS = "cryptd_rejections"
KEYRING_RELOADS = "cryptd_keyring_reloads"
KEY_OPERATIONS = "cryptd_key_operations"  # exported as cryptd_key_operations_total
USAGE_FLUSHES = "cryptd_usage_flushes"
AUDIT_WRITE_FAILURES = "cryptd_audit_write_failures"  # exported with _total
KEY_CHANGE_PROPAGATION = "cryptd_key_change_propagation_seconds"
BUILD_INFO = "cryptd_build_info"
# Audit records that could not be written (the audit module increments it).
# 1 while a store answers, 0 while it does not: store="key" or "replay".
STORE_UP = "cryptd_store_up"
STORES = frozenset({"key", "replay"})
# This host's wall clock minus a reference's, seconds: store="replay" (Redis TIME) or
# "keystore" (the PostgreSQL key store's server clock).
CLOCK_OFFSET = "cryptd_clock_offset_seconds"
CLOCK_REFERENCES = frozenset({"replay", "keystore"})
# Scrape time (process.py, certificate.py).
PROCESS_CPU = "cryptd_process_cpu_seconds"  # exported with _total
PROCESS_RESIDENT_MEMORY = "cryptd_process_resident_memory_bytes"
PROCESS_OPEN_FDS = "cryptd_process_open_fds"
PROCESS_MAX_FDS = "cryptd_process_max_fds"
PROCESS_START_TIME = "cryptd_process_start_time_seconds"
TLS_CERTIFICATE_EXPIRY = "cryptd_tls_certificate_expiry_seconds"

# Counters read from a histogram's _count at scrape time: histogram -> (counter, help).
DERIVED_TOTALS: dict[str, tuple[str, str]] = {
    HTTP_DURATION: (HTTP_REQUESTS, "HTTP requests answered, by route template, method and status."),
    CRYPTO_DURATION: (
        CRYPTO_OPERATIONS,
        "Cryptographic operations (each batch item counts once), by outcome of their chunk.",
    ),
}
WINDOW_SECONDS = "cryptd_latency_window_seconds"

REJECTION_CAUSES = frozenset({"overload", "rate_limit", "body_size"})
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class Families:
    http_duration: Histogram
    crypto_duration: Histogram
    pool_queued: Gauge
    pool_in_flight: Gauge
    pool_max_pending: Gauge
    pool_queue_wait: Histogram
    auth_failures: Counter
    rejections: Counter
    keyring_reloads: Counter
    key_operations: Counter
    usage_flushes: Counter
    audit_write_failures: Counter
    key_change_propagation: Histogram
    store_up: Gauge
    clock_offset: Gauge


def create_families(registry: CollectorRegistry | None) -> Families:
    """Create the stored metrics (in ``registry`` when given).

    ``cryptd_http_requests_total`` and ``cryptd_crypto_operations_total`` are not stored: they
    are derived at scrape time from their latency histogram's counts (see exposition.Totals),
    which saves every observation one write and makes the two agree by construction.

    Pool gauges are ``livesum``: each worker process owns its executors, so the service's queue
    depth is the sum over the workers that are alive (a dead worker's last value must not count).
    """
    return Families(
        http_duration=Histogram(
            HTTP_DURATION,
            "HTTP request latency in seconds, first byte received to last byte sent.",
            ("route", "method", "status"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
        crypto_duration=Histogram(
            CRYPTO_DURATION,
            "Time per cryptographic operation in seconds, measured where it runs; outcome of its"
            " batch chunk: ok, partial, error.",
            ("operation", "key_type", "outcome"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
        pool_queued=_executor_gauge(
            POOL_QUEUED, "Tasks admitted to an executor and waiting for a worker.", registry
        ),
        pool_in_flight=_executor_gauge(
            POOL_IN_FLIGHT, "Tasks running on an executor's workers.", registry
        ),
        pool_max_pending=_executor_gauge(
            POOL_MAX_PENDING,
            "Queued plus running tasks an executor admits before answering 503.",
            registry,
        ),
        pool_queue_wait=Histogram(
            POOL_QUEUE_WAIT,
            "Seconds a task waited in an executor's queue before a worker started it.",
            ("executor",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
        auth_failures=Counter(
            AUTH_FAILURES,
            "Requests refused by request-signature authentication, by reason.",
            ("reason",),
            registry=registry,
        ),
        rejections=Counter(
            REJECTIONS,
            "Requests refused before any work: overload (503), rate_limit (429), body_size (413).",
            ("cause",),
            registry=registry,
        ),
        keyring_reloads=Counter(
            KEYRING_RELOADS,
            "Keyring reloads from the keyring file, by outcome.",
            ("outcome",),
            registry=registry,
        ),
        key_operations=Counter(
            KEY_OPERATIONS,
            "Successful operations per key version (batch items count one each; rewrap counts"
            " rewrap_from and rewrap_to), added when the usage counts are flushed. Keys beyond"
            ' CRYPTD_METRICS_MAX_KEYS count under key and version "_other".',
            ("key", "version", "operation"),
            registry=registry,
        ),
        usage_flushes=Counter(
            USAGE_FLUSHES,
            "Writes of the usage counts to the usage store, by outcome (ok, error).",
            ("outcome",),
            registry=registry,
        ),
        audit_write_failures=Counter(
            AUDIT_WRITE_FAILURES,
            "Audit records that could not be made durable (each one's request was refused 503"
            " audit_unavailable when the audit fails closed).",
            registry=registry,
        ),
        key_change_propagation=Histogram(
            KEY_CHANGE_PROPAGATION,
            "Seconds the answer to a key change waited for the other replicas to enforce it;"
            " outcome confirmed (every live replica did) or incomplete (the timeout passed).",
            ("outcome",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
        # livemin: a store is down for the service as soon as one live worker cannot reach it.
        store_up=Gauge(
            STORE_UP,
            "1 while the store answers this process, 0 while it does not (store: key, replay);"
            " the minimum over the live workers.",
            ("store",),
            multiprocess_mode="livemin",
            registry=registry,
        ),
        # livemostrecent: every worker of the host reads the same clock; the latest reading.
        clock_offset=Gauge(
            CLOCK_OFFSET,
            "This host's wall clock minus a reference's, in seconds (negative: behind), as last"
            " measured: store=replay, Redis TIME (absent without Redis); store=keystore, the"
            " PostgreSQL key store's server clock (absent with the file key store).",
            ("store",),
            multiprocess_mode="livemostrecent",
            registry=registry,
        ),
    )


def _executor_gauge(name: str, documentation: str, registry: CollectorRegistry | None) -> Gauge:
    """A per-executor pool gauge, summed over the live workers (see create_families)."""
    return Gauge(name, documentation, ("executor",), multiprocess_mode="livesum", registry=registry)
