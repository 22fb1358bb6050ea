"""The fault campaign on the test bed: ``python -m loadtest.faults``.

Under a mixed signed load through the load balancer (``faults_load``) and revocation rounds
across hosts (``faults_revocation``), each fault in turn (``testbed_faults``): load for
``--pre`` seconds, the fault, the repair an operator's automation makes (restart, re-attach,
rebuild the standby), a wait until every host is ready and back in the balancer, ``--post``
seconds more; then every request accepted so far is sent again to every host. At the end every
token made still has to decrypt and every acknowledged key change still has to be there.
Writes a Markdown report (``docs/results/faults-<date>.md`` unless ``--report``).

Uses the bed in ``--run-dir`` when one is up, else brings one up and takes it down after.

Faults: ``kill-host``, ``redis-failover``, ``pg-failover``, ``cut-links``, ``clock+10``,
``clock-10``, ``disk-full``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from loadtest.faults_load import Load, ReplayResult, check_integrity, replay
from loadtest.faults_report import PhaseResult, render
from loadtest.faults_revocation import Revocation
from loadtest.phase import rsa_sign_us
from loadtest.testbed import add_window_options, down, up
from loadtest.testbed_faults import (
    cut_links,
    failover_timeline,
    fill_disk,
    free_disk,
    kill_host,
    kill_pg_primary,
    kill_redis_primary,
    rebuild_pg_standby,
    restart_host,
    restart_redis,
    step_clock,
)
from loadtest.testbed_net import BedError
from loadtest.testbed_services import host_ready, lb_errors, lb_servers, redis_client, wait_for
from loadtest.testbed_topology import (
    APPS,
    DEFAULT_PREFIX,
    DEFAULT_RUN_DIR,
    DEFAULT_SUBNET,
    REDIS_SERVICE,
    Bed,
)

# Requests younger than this may still pass a host's age check (signature_max_age 300 s plus
# a margin for a host whose clock is ahead); EARLIER_SAMPLE of them are replayed again.
YOUNG = 330.0
EARLIER_SAMPLE = 1000
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
FAULTS = (
    "kill-host",
    "redis-failover",
    "pg-failover",
    "cut-links",
    "clock+10",
    "clock-10",
    "disk-full",
)


@dataclass(frozen=True)
class Timing:
    pre: float  # load before the fault
    post: float  # load after recovery
    hold: float  # how long a host stays killed / skewed / full
    cut: float  # how long links stay cut
    recovery_timeout: float


def recovered(bed: Bed, timeout: float) -> float | None:
    """The monotonic time at which every host answered /readyz and the balancer had them all
    UP (None: not within ``timeout``)."""

    def healthy() -> bool:
        return all(host_ready(bed, a) for a in APPS) and all(
            lb_servers(bed).get(a) == "UP" for a in APPS
        )

    try:
        wait_for("recovery", healthy, timeout)
    except BedError:
        return None
    return time.monotonic()


def apply(bed: Bed, fault: str, phase: PhaseResult, timing: Timing) -> None:
    """The fault and its repair; ``phase.fault_at`` is set when the fault begins."""
    phase.fault_at = time.monotonic()
    if fault == "kill-host":
        record = kill_host(bed, phase.target)
        time.sleep(timing.hold)
        phase.details["restart_s"] = round(restart_host(bed, phase.target), 2)
    elif fault == "redis-failover":
        record = kill_redis_primary(bed)
        phase.target = record.target
        phase.timeline_from = record.wall
        time.sleep(1)
        phase.details["restart_old_s"] = round(restart_redis(bed, record.target), 2)
    elif fault == "pg-failover":
        record = kill_pg_primary(bed)
        phase.target = record.target
        phase.details["rebuild_standby_s"] = round(rebuild_pg_standby(bed, record.target), 2)
    elif fault == "cut-links":
        record = cut_links(bed, phase.target, timing.cut)
    elif fault in ("clock+10", "clock-10"):
        record = step_clock(bed, phase.target, 10 if fault == "clock+10" else -10)
        time.sleep(timing.hold)
        step_clock(bed, phase.target, 0)
    elif fault == "disk-full":
        record = fill_disk(bed, phase.target)
        time.sleep(timing.hold)
        free_disk(bed, phase.target)
    else:
        raise ValueError(f"unknown fault {fault}")
    phase.details.update(record.details)


def failback_redis(bed: Bed, phase: PhaseResult, timeout: float) -> None:
    """With ``--redis direct`` cryptd knows only the first primary: after a failover it stays
    refused until that Redis is primary again. Ask the Sentinels to fail back, and say so."""
    sentinel = redis_client(bed, "sentinel1")
    with contextlib.suppress(redis.RedisError):
        sentinel.execute_command("SENTINEL", "FAILOVER", REDIS_SERVICE)  # type: ignore[no-untyped-call]
    phase.notes.append(
        "cryptd was given redis:// (the first primary): it could not follow the failover; "
        "the bed asked the Sentinels to fail back to it (SENTINEL FAILOVER) — with "
        "redis+sentinel:// (`--redis sentinel`) this step goes away"
    )
    again = recovered(bed, timeout)
    phase.recovered_s = None if again is None else again - phase.fault_at


def run_fault(
    bed: Bed,
    fault: str,
    target: str,
    timing: Timing,
    load: Load,
    revocation: Revocation,
    log: Callable[[str], None],
) -> PhaseResult:
    phase = PhaseResult(fault, target, time.monotonic())
    revocation.phase = fault
    time.sleep(timing.pre)
    log(f"{fault} on {target}")
    apply(bed, fault, phase, timing)
    healthy = recovered(bed, timing.recovery_timeout)
    phase.recovered_s = None if healthy is None else healthy - phase.fault_at
    if fault == "redis-failover" and phase.timeline_from:
        # Seconds after the kill: detection, switch, cryptd reaching the new primary, the end
        # of its epoch window (the refusal window the load saw is in the table).
        promoted = str(phase.details.get("promoted", ""))
        phase.details.update(failover_timeline(bed, phase.timeline_from, promoted))
    if fault == "redis-failover" and bed.redis_mode == "direct":
        with contextlib.suppress(Exception):
            if _redis_refused(bed):
                failback_redis(bed, phase, timing.recovery_timeout)
    if phase.recovered_s is None:
        phase.notes.append(f"not recovered within {timing.recovery_timeout:.0f} s")
    time.sleep(timing.post)
    phase.ended = time.monotonic()
    # Rounds during the replay burst are labelled apart from the fault and from steady load.
    revocation.phase = f"replays after {fault}"
    with load.recorder.lock:
        accepted = list(load.recorder.accepted)
    current = [a for a in accepted if phase.started <= a.at < phase.ended]
    # Earlier phases' requests were replayed after their own fault; a later fault (a replay
    # store that lost its nonces) could reopen them, so a sample of those still young enough to
    # pass the age check goes again (older ones are refused by their age alone).
    earlier = [a for a in accepted if phase.ended - YOUNG < a.at < phase.started]
    sample = random.sample(earlier, min(len(earlier), EARLIER_SAMPLE))
    log(f"{fault}: replaying {len(current)} + {len(sample)} earlier requests at every host")
    phase.replay = replay(current + sample, [bed.host_url(a) for a in APPS])
    revocation.phase = "steady"
    return phase


def _redis_refused(bed: Bed) -> bool:
    """Whether the Redis cryptd was pointed at is no longer the primary."""
    return bool(redis_client(bed, "redis1").info("replication")["role"] != "master")


@contextlib.contextmanager
def bed_for(args: argparse.Namespace) -> Iterator[Bed]:
    if (args.run_dir / "state.json").exists():
        bed = Bed.load(args.run_dir)
        wanted = (args.redis, args.max_skew, args.down_after_ms)
        if (bed.redis_mode, bed.max_skew, bed.sentinel_down_after_ms) != wanted:
            raise BedError(
                f"the bed up in {args.run_dir} has --redis {bed.redis_mode} --max-skew "
                f"{bed.max_skew} --down-after-ms {bed.sentinel_down_after_ms}, not what was "
                "asked: take it down first (python -m loadtest.testbed down)"
            )
        yield bed
        return
    bed = Bed(
        args.run_dir,
        args.prefix,
        args.subnet,
        redis_mode=args.redis,
        max_skew=args.max_skew,
        sentinel_down_after_ms=args.down_after_ms,
    )
    try:
        up(bed)
        yield bed
    except BaseException:
        # A campaign that fails leaves its bed up: the hosts' logs say why, and down removes them.
        print(
            f"the bed is left up for its logs ({bed.run_dir}); "
            "python -m loadtest.testbed down removes it",
            file=sys.stderr,
        )
        raise
    if not args.keep:
        down(bed.run_dir, bed.prefix)


def campaign(
    bed: Bed, faults: list[str], timing: Timing, threads: int, report: Path
) -> dict[str, int]:
    """Run the campaign; returns the goal counters (all 0 when every goal is met)."""
    started = time.monotonic()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    client_id, secret = "bed", bed.secret()
    load = Load(bed.url, client_id, secret, threads)
    load.prepare()
    revocation = Revocation({a: bed.host_url(a) for a in APPS}, bed.workers, client_id, secret)
    phases: list[PhaseResult] = []
    targets = {
        "kill-host": "app2",
        "cut-links": "app3",
        "clock+10": "app1",
        "clock-10": "app1",
        "disk-full": "app2",
    }
    load.start()
    revocation.start()
    try:
        for fault in faults:
            phases.append(
                run_fault(bed, fault, targets.get(fault, ""), timing, load, revocation, log)
            )
    finally:
        revocation.stop()
        load.stop()
    # What each phase's replay did not cover yet: accepted after the last phase ended.
    last = phases[-1].ended if phases else 0.0
    rest = [a for a in load.recorder.accepted if a.at >= last]
    log(f"replaying the last {len(rest)} accepted requests; integrity checks")
    final: ReplayResult = replay(rest, [bed.host_url(a) for a in APPS])
    integrity = check_integrity(bed.url, client_id, secret, load.recorder)
    setup = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine phase": f"RSA-2048 PSS sign {rsa_sign_us(0.3, 3):.0f} µs in a bare loop",
        "bed": (
            f"3 cryptd hosts x {bed.workers} workers behind HAProxy; Redis primary + replica + "
            "3 Sentinels; PostgreSQL primary + streaming standby "
            f"({'synchronous' if bed.pg_sync else 'asynchronous'}); one network namespace each"
        ),
        "cryptd's Redis URL": f"`{bed.redis_url()}`",
        "refusal window settings": (
            "CRYPTD_SIGNATURE_MAX_SKEW "
            f"{'5 (default)' if bed.max_skew is None else bed.max_skew} s, Sentinel "
            f"down-after-milliseconds {bed.sentinel_down_after_ms}"
        ),
        "key store URL": f"`{bed.keystore_url()}`",
        "load": (
            f"{threads} crypto threads + 1 key-management thread (cryptd_client, retries on), "
            "through HAProxy"
        ),
        "timing": (
            f"{timing.pre:g} s before each fault, hold {timing.hold:g} s, links cut "
            f"{timing.cut:g} s, {timing.post:g} s after recovery"
        ),
        "command": "`python -m loadtest.faults " + " ".join(sys.argv[1:]) + "`",
    }
    text = render(
        title="Fault campaign on the multi-host test bed",
        setup=setup,
        phases=phases,
        outcomes=list(load.recorder.outcomes),
        rounds=revocation.rounds,
        revocation_errors=revocation.errors,
        integrity=integrity,
        final_replay=final,
    )
    bad_5xx = [o for o in load.recorder.outcomes if o.status >= 500 and o.status != 503]
    if bad_5xx:
        lines = lb_errors(bed, {o.status for o in bad_5xx})
        text += (
            "\n## 5xx other than 503: what the balancer logged\n\n"
            f"{len(bad_5xx)} answers; HAProxy's log line of each session it answered so "
            "(httplog: the server, the timers, the status, the termination state):\n\n"
            + "".join(f"    {line}\n" for line in lines[:20])
            + ("" if lines else "    (none logged)\n")
        )
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    log(f"report: {report}")
    return {
        "replays_passed": final.passed + sum(p.replay.passed for p in phases if p.replay),
        "tokens_failed": integrity.tokens_failed,
        "keys_lost": len(integrity.keys_lost),
        "revocation_served_after": sum(r.served_after for r in revocation.rounds),
        "5xx_not_503": len(bad_5xx),
        "accepted": len(load.recorder.accepted),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.faults", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}"
    )
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--pre", type=float, default=5.0)
    parser.add_argument("--post", type=float, default=10.0)
    parser.add_argument("--hold", type=float, default=10.0)
    parser.add_argument("--cut", type=float, default=30.0)
    parser.add_argument("--recovery-timeout", type=float, default=60.0)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--subnet", default=DEFAULT_SUBNET)
    parser.add_argument("--redis", choices=("direct", "sentinel"), default="direct")
    parser.add_argument("--keep", action="store_true", help="leave a bed this run brought up")
    add_window_options(parser)
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults: {', '.join(unknown)}")
    if os.geteuid() != 0:
        print("the test bed needs root (network namespaces, mounts)", file=sys.stderr)
        return 2
    report = args.report or RESULTS / f"faults-{datetime.date.today().isoformat()}.md"
    timing = Timing(args.pre, args.post, args.hold, args.cut, args.recovery_timeout)
    with bed_for(args) as bed:
        goals = campaign(bed, faults, timing, args.threads, report)
        failed = {k: v for k, v in goals.items() if k != "accepted" and v}
        if failed and not args.keep:
            args.keep = True  # a missed goal leaves the bed up for its logs, as a crash does
            print(f"goals missed; the bed is left up for its logs ({bed.run_dir})", file=sys.stderr)
    print(goals)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
