"""Prometheus metrics for cryptd, correct across worker processes (see docs/OBSERVABILITY.md)."""

from service.metrics.core import Metrics
from service.metrics.definitions import LATENCY_BUCKETS
from service.metrics.exposition import render_directory
from service.metrics.multiproc import init_multiprocess_dir, mark_worker_dead

__all__ = [
    "LATENCY_BUCKETS",
    "Metrics",
    "init_multiprocess_dir",
    "mark_worker_dead",
    "render_directory",
]
