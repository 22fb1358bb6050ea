"""Load tests for cryptd: signed wrk scripts (``loadtest/wrk``), a locust file, and the runner
that compares cryptd with OpenBao's Transit engine on the same machine
(``python -m loadtest.run``; method and figures in docs/PERFORMANCE.md)."""
