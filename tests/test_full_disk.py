"""A full disk never kills a process: prometheus-client's memory-mapped metric files
(service/metrics/mmapfile.py) and a server whose audit log, metrics and runtime directories
share one small tmpfs that fills up (each in a private mount namespace, as root)."""

from __future__ import annotations

import base64
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, start_server, stop_server
from tests.test_keystore_support import fill, needs_root, needs_tool

pytestmark = pytest.mark.slow

# Runs in a private mount namespace with a 256 KiB tmpfs at argv[1]: makes a metric file,
# fills the disk, adds series (each write to a page nobody reserved would be a SIGBUS), frees
# the disk and writes once more. argv[2] "stock" uses prometheus-client's own class.
_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from prometheus_client.mmap_dict import MmapedDict
    from service.metrics.mmapfile import ReservedMmapedDict
    disk, which = sys.argv[1], sys.argv[2]
    cls = MmapedDict if which == "stock" else ReservedMmapedDict
    name = os.path.join(disk, "counter_1.db")
    d = cls(name)
    d.write_value("before", 1.0, 0.0)
    filler = open(os.path.join(disk, "filler"), "wb", buffering=0)
    for size in (65536, 4096, 512, 1):
        try:
            while True:
                filler.write(b"x" * size)
        except OSError:
            pass
    keys = [f"series-{i:04d}-" + "k" * 200 for i in range(400)]  # ~100 KiB: many new pages
    for i, key in enumerate(keys):
        d.write_value(key, float(i), 0.0)
    late = cls(os.path.join(disk, "counter_2.db"))  # a new file while full
    late.write_value("late", 5.0, 0.0)
    print("survived", flush=True)
    filler.close()
    os.unlink(os.path.join(disk, "filler"))
    d._retry_at = late._retry_at = 0.0  # space is back: no need to wait out the retry interval
    d.write_value("before", 2.0, 0.0)  # any write stores the series that waited
    late.write_value("other", 1.0, 0.0)
    d.close(); late.close()
    values = dict((k, v) for k, v, *_ in MmapedDict.read_all_values_from_file(name))
    late_values = dict((k, v) for k, v, *_ in MmapedDict.read_all_values_from_file(
        os.path.join(disk, "counter_2.db")))
    print("stored", sum(values.get(k) == float(i) for i, k in enumerate(keys)), "of", len(keys))
    print("before", values["before"], "late", late_values["late"])
    """
)


def _in_small_tmpfs(tmp_path: Path, which: str) -> subprocess.CompletedProcess[str]:
    needs_root("mounting a tmpfs in a private mount namespace")
    disk = tmp_path / which
    disk.mkdir()
    return subprocess.run(
        [
            needs_tool("unshare"), "--mount", "--propagation", "private", "/bin/sh", "-c",
            'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"', str(disk),
            sys.executable, "-c", _SCRIPT, str(disk), which,
        ],
        capture_output=True, text=True, timeout=60, check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip


def test_prometheus_clients_own_file_dies_of_sigbus_on_a_full_tmpfs(tmp_path: Path) -> None:
    """What the next test guards against, shown on the unchanged class."""
    done = _in_small_tmpfs(tmp_path, "stock")
    assert done.returncode == -7, done.stdout + done.stderr  # SIGBUS
    assert "survived" not in done.stdout


def test_a_reserved_file_keeps_new_series_out_until_space_returns(tmp_path: Path) -> None:
    done = _in_small_tmpfs(tmp_path, "reserved")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "survived" in done.stdout
    # Once space returned, every series that waited is in the file with its last value.
    assert "stored 400 of 400" in done.stdout
    assert "before 2.0 late 5.0" in done.stdout


def _workers(server: Server) -> set[int]:
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(c) for c in children}


def _call(server: Server, path: str) -> httpx.Response:
    return server.request("POST", path, {"plaintext": base64.b64encode(b"full").decode()})


def test_a_full_disk_refuses_with_retry_after_and_no_worker_dies(tmp_path: Path) -> None:
    """Two server workers whose audit log, metrics files and runtime directory share one
    2 MiB tmpfs (as on the test bed's hosts) that fills up: every answer is a 200 (its record
    fitted) or 503 audit_unavailable with Retry-After, /readyz says why, no worker dies (new
    metric series among them: new statuses, new routes), and once space returns the same
    workers answer 200 and /metrics is whole again, with no restart."""
    needs_root("mounting a tmpfs in a private mount namespace")
    disk = tmp_path / "disk"
    disk.mkdir()
    prefix = [
        needs_tool("unshare"), "--mount", "--propagation", "private", "/bin/sh", "-c",
        'mount -t tmpfs -o size=2m,mode=0700 tmpfs "$0" && mkdir "$0/metrics" "$0/run" '
        '&& exec "$@"', str(disk),
    ]  # fmt: skip
    env = {
        "CRYPTD_AUDIT_LOG": str(disk / "audit.log"),
        "CRYPTD_AUDIT_FAIL_CLOSED": "true",
        "PROMETHEUS_MULTIPROC_DIR": str(disk / "metrics"),
        "CRYPTD_RUNTIME_DIR": str(disk / "run"),
    }
    server = start_server(tmp_path, env, workers=2, prefix=prefix)
    try:
        seen = Path(f"/proc/{server.process.pid}/root") / disk.relative_to("/")
        assert _call(server, "/v1/encrypt/aes256-gcm").status_code == 200
        workers = _workers(server)
        assert len(workers) >= 2  # the server workers (and any helper process)
        filler = fill(seen)
        statuses: list[int] = []

        for i in range(25):  # a missing key's 404 and the 503s are series no worker had yet
            for path in ("/v1/encrypt/aes256-gcm", f"/v1/encrypt/absent-{i}", "/v1/hmac/x"):
                answer = _call(server, path)
                statuses.append(answer.status_code)
                assert answer.status_code < 500 or answer.status_code == 503, answer.text
                if answer.status_code == 503:
                    assert answer.json()["error"]["code"] == "audit_unavailable"
                    assert int(answer.headers["retry-after"]) >= 1
        assert statuses.count(503) > 40, statuses  # the audit log filled: refused from then on
        body = httpx.get(server.url + "/readyz", timeout=5)
        assert body.status_code == 503
        assert any("No space left" in reason for reason in body.json()["reasons"])
        assert _workers(server) == workers
        filler.unlink()
        deadline = time.monotonic() + 20
        while (status := _call(server, "/v1/encrypt/aes256-gcm").status_code) != 200:
            statuses.append(status)
            assert time.monotonic() < deadline, "not serving again after the disk was freed"
            time.sleep(0.2)
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "not ready again after the disk was freed"
            time.sleep(0.2)
        assert _workers(server) == workers  # the same processes: nothing was restarted
        time.sleep(1.5)  # series left out while full are stored at their file's next write
        for _ in range(6):  # reaches both workers (the kernel spreads new connections)
            _call(server, "/v1/encrypt/aes256-gcm")
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        refused = [
            line for line in metrics.splitlines()
            if line.startswith("cryptd_http_requests_total{")
            and 'status="503"' in line
            and 'route="/v1/' in line
        ]  # fmt: skip
        assert refused, "the refusals made while full are missing from /metrics"
        assert sum(float(line.rsplit(" ", 1)[1]) for line in refused) == statuses.count(503)
        assert "server worker exited" not in server.log()
    finally:
        stop_server(server)
