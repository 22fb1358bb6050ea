"""Master-key rotation under load: ``--versions`` key versions (default 10,000) rewrapped online
while crypto is served, and the crypto P99 during the rotation against its value without one,
in the same run. ``python -m loadtest.rotation_load``.

Before the server starts, its key store gets the versions in one store transaction
(``--per-key`` AES-256-GCM versions per key, :func:`add_versions`; the seconds it took are
reported): 10,000 ``POST /v1/keys/.../rotate`` calls would each rewrite the whole store.
One server (``--workers``, default 1; ``--seal static`` or ``pkcs11``, loadtest/seals.py) on
the server CPUs of the pinned topology, wrk on the others driving signed ``--scenario``
requests. Each round makes two measurements, in alternating order: a quiet one, and one in
which ``POST /v1/sys/rotate-master-key`` is sent ``--lead`` seconds in. The figure is the
median over the rounds of P99 (rotating) / P99 (quiet); goal: at most 2. A rotation that
outlasts its window, or any failed request, fails the run.

The report (JSON) goes to ``loadtest/results/``; with ``--record`` the summary is written as
``docs/results/DATE-rotation-load.md``. Run it on a quiet machine: never in CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import alternate
from loadtest.measure import Measurement, run_wrk
from loadtest.phase import describe, rsa_sign_us
from loadtest.plan import make_topology
from loadtest.seals import sealed_server
from loadtest.targets import Cryptd
from service.config import decode_master_key
from service.crypto.registry import KEY_TYPES
from service.keys.document import KeyRecord, KeyringDocument, utc_now
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.records import wrap_version
from service.stores import open_store

GOAL = 2.0  # P99 while rotating, at most this many times the quiet P99
TYPE = "aes256-gcm"


def add_versions(dev: Path, versions: int, per_key: int) -> float:
    """Add ``versions`` AES-256-GCM versions (``per_key`` a key, keys ``bulk-N``) to the
    development keyring in ``dev`` in one store transaction; the seconds it took."""
    started = time.monotonic()
    master = MasterKey(decode_master_key((dev / "master.key").read_text(), "master.key"))
    manager = KeyManager(open_store(None, dev / "keyring.json"), master)
    try:
        manager.load()
        generate = KEY_TYPES[TYPE].generate
        now = utc_now()

        def change(document: KeyringDocument) -> None:
            for number in range(0, versions, per_key):
                name = f"bulk-{number // per_key}"
                count = min(per_key, versions - number)
                document.keys[name] = KeyRecord(
                    type=TYPE,
                    created_at=now,
                    versions=[
                        wrap_version(master, name, TYPE, v, generate(), now)
                        for v in range(1, count + 1)
                    ],
                )

        manager.snapshot.apply(change)
    finally:
        manager.store.close()
    return time.monotonic() - started


def rotate_after(server: Cryptd, lead: float, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        time.sleep(lead)
        started = time.monotonic()
        try:
            status, body = server.request("/v1/sys/rotate-master-key", {})
        except Exception as exc:  # reported, and the round fails
            status, body = 0, {"error": f"{type(exc).__name__}: {exc}"}
        out.update(status=status, body=body, seconds=time.monotonic() - started)

    thread = threading.Thread(target=run, name="rotation", daemon=True)
    thread.start()
    return thread


def measure(server: Cryptd, args: argparse.Namespace, rotating: bool) -> dict[str, Any]:
    rotation: dict[str, Any] = {}
    thread = rotate_after(server, args.lead, rotation) if rotating else None
    measured: Measurement = run_wrk(
        "cryptd.lua",
        server.url,
        [args.scenario],
        connections=args.connections,
        duration=args.duration,
        env={"CRYPTD_CREDENTIALS": str(server.credentials)},
        server_pid=server.pid,
    )
    result: dict[str, Any] = {
        "requests": measured.requests,
        "errors": measured.errors,
        "rps": round(measured.requests / measured.seconds, 1),
        "p50_ms": measured.p50_ms,
        "p99_ms": measured.p99_ms,
        "max_ms": measured.max_ms,
    }
    if thread is not None:
        result["rotation_in_window"] = not thread.is_alive()  # wrk is done: was the rotation?
        thread.join()
        result["rotation"] = {
            "status": rotation.get("status"),
            "seconds": round(rotation.get("seconds", 0.0), 3),
            **{k: rotation.get("body", {}).get(k) for k in ("versions", "master_key_id")},
        }
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.rotation_load", description=__doc__)
    parser.add_argument("--versions", type=int, default=10_000, help="versions to rewrap")
    parser.add_argument("--per-key", type=int, default=100, help="versions per key")
    parser.add_argument("--seal", choices=("static", "pkcs11"), default="static")
    parser.add_argument("--workers", type=int, default=1, help="server workers")
    parser.add_argument("--scenario", default="aes-encrypt", help="wrk scenario (cryptd.lua)")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of measurements")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--lead", type=float, default=1.0, help="seconds before the rotation")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections")
    parser.add_argument("--shared-cores", action="store_true", help="no pinning")
    parser.add_argument("--client-cpus", help="CPUs of wrk (default: the first half)")
    parser.add_argument("--server-cpus", help="CPUs of the servers (default: the rest)")
    parser.add_argument("--out", type=Path, help="the JSON report (default: loadtest/results/)")
    parser.add_argument(
        "--record", action="store_true", help="also write docs/results/DATE-rotation-load.md"
    )
    args = parser.parse_args(argv)
    if min(args.versions, args.per_key, args.rounds, args.connections, args.workers) < 1:
        parser.error("--versions, --per-key, --rounds, --connections, --workers: at least 1")
    if args.duration <= args.lead or args.lead < 0:
        parser.error("--duration must be longer than --lead")
    return args


def verdict(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [
        r["rotating"]["p99_ms"] / r["quiet"]["p99_ms"] if r["quiet"]["p99_ms"] else float("nan")
        for r in rounds
    ]
    clean = all(r[kind]["errors"] == 0 for r in rounds for kind in ("quiet", "rotating")) and all(
        r["rotating"]["rotation"]["status"] == 200 and r["rotating"]["rotation_in_window"]
        for r in rounds
    )
    ratio = statistics.median(ratios)
    return {
        "p99_ratios": [round(r, 3) for r in ratios],
        "p99_ratio": round(ratio, 3),
        "goal": GOAL,
        "clean": clean,
        "met": clean and ratio <= GOAL,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    topology = make_topology(args)
    rounds: list[dict[str, Any]] = []
    created: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="cryptd-rotation-load-") as scratch:
        server = sealed_server(
            args.seal,
            Path(scratch),
            cpus=topology.server_cpus,
            workers=args.workers,
            prepare=lambda dev: created.update(
                seconds=add_versions(dev, args.versions, args.per_key)
            ),
        )
        print(f"{args.versions:,} versions made in {created['seconds']:.2f} s", file=sys.stderr)
        try:
            server.start()
            if topology.pinned:
                os.sched_setaffinity(0, topology.client)
            for number in range(args.rounds):
                order = (False, True) if number % 2 == 0 else (True, False)
                found = {
                    ("rotating" if rotating else "quiet"): measure(server, args, rotating)
                    for rotating in order
                }
                rounds.append(found)
                print(
                    f"round {number + 1}/{args.rounds}: P99 quiet {found['quiet']['p99_ms']:.2f}"
                    f" ms, rotating {found['rotating']['p99_ms']:.2f} ms; rotation"
                    f" {found['rotating']['rotation']['seconds']:.2f} s",
                    file=sys.stderr,
                )
        finally:
            server.stop()
    stamp = alternate.stamp()
    summary = {
        "topology": topology.summary(),
        "phase": describe(rsa_sign_us()),
        "versions": args.versions,
        "versions_made_s": round(created["seconds"], 3),
        "seal": args.seal,
        "workers": args.workers,
        "rounds": rounds,
        **verdict(rounds),
    }
    alternate.publish(
        "rotation-load", summary, markdown(summary, args, stamp), stamp, args.out, args.record
    )
    return 0 if summary["met"] else 1


def markdown(summary: dict[str, Any], args: argparse.Namespace, stamp: str) -> str:
    rows = "\n".join(
        f"| {n} | {r['quiet']['rps']:,.0f} | {r['quiet']['p99_ms']:.2f}"
        f" | {r['rotating']['rps']:,.0f} | {r['rotating']['p99_ms']:.2f}"
        f" | {r['rotating']['rotation']['seconds']:.2f} |"
        for n, r in enumerate(summary["rounds"], 1)
    )
    return (
        f"# Master-key rotation under load ({stamp})\n\n"
        f"- {summary['topology']}; {summary['phase']}\n"
        f"- `python -m loadtest.rotation_load --versions {args.versions} --per-key {args.per_key}"
        f" --seal {args.seal} --workers {args.workers} --scenario {args.scenario} --rounds"
        f" {args.rounds} --duration {args.duration:g} --connections {args.connections}`\n"
        f"- {summary['versions']:,} versions made in one store transaction in"
        f" {summary['versions_made_s']:.2f} s\n\n"
        "| round | quiet req/s | quiet P99 ms | rotating req/s | rotating P99 ms | rotation s |\n"
        f"|---|---|---|---|---|---|\n{rows}\n\n"
        f"**P99 rotating / quiet: {summary['p99_ratio']:.2f}** (median; goal <= {GOAL:g});"
        f" every request answered and every rotation done in its window:"
        f" {'yes' if summary['clean'] else 'NO'}."
    )


if __name__ == "__main__":
    sys.exit(main())
