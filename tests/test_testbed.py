"""The multi-host test bed (loadtest/testbed*.py) and the fault campaign (loadtest/faults*.py).

The slow tests bring a real bed up (network namespaces, HAProxy, Redis + Sentinels,
PostgreSQL primary + standby, three cryptd hosts): they need root and those programs; where
they are missing the tests are skipped, under CI=true they fail."""

from __future__ import annotations

import datetime
import os
import secrets
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from loadtest.faults import Timing, campaign
from loadtest.faults_load import Integrity, Outcome, ReplayResult, operation_of
from loadtest.faults_report import PhaseResult, refusal_window, refusals, render
from loadtest.faults_revocation import Round, parse_propagation
from loadtest.faults_revocation_lanes import LaneReading, Probe, figures, read_lane
from loadtest.testbed import down, up
from loadtest.testbed_faults import failover_timeline
from loadtest.testbed_net import BedError, mounts_under, namespaces
from loadtest.testbed_services import check_programs, lb_errors, wait_for
from loadtest.testbed_topology import Bed


def test_the_redis_url_comes_from_one_switch() -> None:
    direct = Bed(subnet="10.9.8")
    sentinel = Bed(subnet="10.9.8", redis_mode="sentinel")
    assert direct.redis_url() == "redis://10.9.8.31:6379/0"
    assert sentinel.redis_url() == (
        "redis+sentinel://10.9.8.41:26379,10.9.8.42:26379,10.9.8.43:26379/cryptd"
    )


def test_the_key_store_url_names_both_postgresql_hosts_and_asks_for_the_writable_one() -> None:
    url = Bed(subnet="10.9.8").keystore_url()
    assert url.startswith("postgresql://postgres@10.9.8.21:5432,10.9.8.22:5432/cryptd?")
    assert "target_session_attrs=read-write" in url


@pytest.mark.parametrize(
    ("method", "path", "content", "expected"),
    [
        ("POST", "/v1/encrypt/k", b'{"plaintext":"aGk="}', "encrypt"),
        ("POST", "/v1/encrypt/k", b'{"batch":[]}', "batch-encrypt"),
        ("POST", "/v1/keys/k", b"{}", "create"),
        ("POST", "/v1/keys/k/rotate", b"", "rotate"),
        ("PATCH", "/v1/keys/k", b"{}", "state"),
        ("GET", "/v1/keys/k?x=1", b"", "read"),
    ],
)
def test_operation_names(method: str, path: str, content: bytes, expected: str) -> None:
    assert operation_of(method, path, content) == expected


def test_refusals_after_the_fault_are_counted_and_spanned() -> None:
    phase = PhaseResult("kill-host", "app2", started=0.0, fault_at=10.0, ended=30.0)
    outcomes = [
        Outcome(5.0, "encrypt", 503, True),  # before the fault: counted, not in the window
        Outcome(11.0, "encrypt", 0, False),
        Outcome(12.0, "sign", 200, False),
        Outcome(13.5, "sign", 503, False),
        Outcome(14.0, "sign", 500, False),
        Outcome(40.0, "sign", 503, True),  # after the phase
    ]
    r = refusals(phase, outcomes)
    assert (r.requests, r.accepted) == (5, 1)
    assert r.span_s == pytest.approx(3.0)  # first to last refusal
    # Send times unknown: answer times stand in. 11.0 to the acceptance at 12.0, and the run
    # from 13.5 that nothing accepted followed, to its last answer at 14.0.
    assert r.window_s == pytest.approx(1.0)
    assert r.bad_5xx == 1
    assert r.without_retry_after == 1
    assert r.by_status == Counter({503: 2, 0: 1, 500: 1})


def test_the_refusal_window_is_the_longest_run_of_refusals_not_first_to_last() -> None:
    """Scattered refusals 22 s apart (the host-loss row that read 22.4 s) against one
    contiguous outage: the window is the longest stretch clients were refused, from a
    refusal's send time to the next accepted request's send time."""

    def sent(at: float, status: int, answered_after: float = 0.05) -> Outcome:
        return Outcome(at + answered_after, "encrypt", status, status == 503, sent=at)

    accepted_every_100ms = [sent(t / 10, 200) for t in range(0, 300)]
    scattered = [*accepted_every_100ms, sent(3.05, 503), sent(25.05, 0, answered_after=0.4)]
    phase = PhaseResult("kill-host", "app2", started=0.0, fault_at=0.0, ended=31.0)
    r = refusals(phase, scattered)
    assert r.span_s == pytest.approx(22.35)  # first to last answer: what the column said
    assert r.window_s == pytest.approx(0.05)  # each refusal was followed at once by a success
    assert refusal_window(scattered) == pytest.approx(0.05)

    # One outage: nothing accepted from 10.0 to 14.2 (sent), refusals in between; the
    # clients were refused from the first refusal's send (10.0) to the next acceptance (14.2).
    outage = [o for o in accepted_every_100ms if not 10.0 <= o.sent < 14.2]
    outage += [sent(10.0 + n * 0.25, 503) for n in range(17)]  # 10.0 .. 14.0
    assert refusal_window(outage) == pytest.approx(4.2)
    # Concurrent clients: the order is by send time, not by answer. A refusal that was sent
    # before an acceptance but answered after it does not join the run that follows.
    late = [sent(1.0, 503, answered_after=2.0), sent(1.5, 200), sent(2.0, 503), sent(2.6, 200)]
    assert refusal_window(late) == pytest.approx(0.6)
    # Refused until the end: up to the last refusal's answer.
    assert refusal_window([sent(1.0, 200), sent(2.0, 503), sent(3.0, 503)]) == pytest.approx(1.05)
    assert refusal_window([sent(1.0, 200)]) == 0.0


def test_the_report_states_every_goal() -> None:
    phase = PhaseResult("kill-host", "app2", started=0.0, fault_at=1.0, ended=5.0)
    phase.recovered_s = 2.5
    phase.replay = ReplayResult(6, Counter({401: 5, 200: 1}))
    text = render(
        title="t",
        setup={"bed": "b"},
        phases=[phase],
        outcomes=[
            Outcome(2.0, "encrypt", 200, False),
            Outcome(1.5, "sign", 503, True, "overloaded: replay store unavailable"),
        ],
        rounds=[
            Round("kill-host", 0.012, 0, 6, 0, 0.001, 0.011, 3, 3, 0.040, first_refused=5),
            Round(
                "steady",
                *(0.008, 0, 6, 0, 0.002, 0.006, 3, 2, 0.020),
                other_refusals=1,
                first_refused=1,
                unrelated_first=1,
                key_disabled_after=0.030,
            ),
        ],
        revocation_errors=[],
        integrity=Integrity(tokens=10, tokens_failed=0, keys=3),
        final_replay=ReplayResult(3, Counter({401: 3})),
    )
    # Refused at 1.5 (sent), accepted at 2.0: half a second; one refusal spans nothing.
    assert "| kill-host | app2 | 2 | 1 | 503x1 | 0.50 | 0.00 | 0 | 0 | 2.5 | 6 / 1 |" in text
    assert "- kill-host: refusals at +0.50 s; 503 overloaded: replay store unavailable x1" in text
    assert "**1 replays in all got past" in text
    assert (
        "| all | 2 | 8 / 12 / 12 | 2 | 6 of 12 | 1 | 30 | 11 | 20 / 40 | 1 | 0 | 0 | 1 | 0 |"
        in text
    )
    assert "no longer decrypting: **0**" in text


def test_a_call_served_after_a_lost_answer_is_accepted_with_its_whole_wait() -> None:
    """A host cut off with a request in flight: the balancer closes the session when it takes
    the host out, the client sends the crypto call again and another host serves it. Not a
    refusal; the wait, from the first attempt, is in the notes."""
    phase = PhaseResult("cut-links", "app3", started=0.0, fault_at=1.0, ended=10.0)
    lost = ("RemoteProtocolError",)
    outcomes = [
        Outcome(1.1, "encrypt", 200, False, sent=1.05),
        Outcome(2.5, "sign", 200, False, sent=2.45, lost=lost, first_sent=1.0),
        Outcome(2.6, "encrypt", 200, False, sent=2.5, lost=lost, first_sent=1.1),
    ]
    assert outcomes[1].latency == pytest.approx(1.5)
    assert outcomes[0].latency == pytest.approx(0.05)
    r = refusals(phase, outcomes)
    assert (r.requests, r.accepted, r.window_s) == (3, 3, 0.0)
    text = render(
        title="t",
        setup={},
        phases=[phase],
        outcomes=outcomes,
        rounds=[],
        revocation_errors=[],
        integrity=Integrity(),
        final_replay=ReplayResult(),
    )
    assert (
        "- cut-links: 2 calls accepted after an attempt without answer (RemoteProtocolError x2),"
        " answered 1.50 / 1.50 s (median / max) after their first attempt left" in text
    )


def _lane(answered: float, *answers: tuple[float, int, str]) -> LaneReading:
    """A worker's probes sent at ``answered`` + each offset, each answered 20 ms later."""
    probes = [Probe(answered + at, answered + at + 0.02, st, code) for at, st, code in answers]
    reading = read_lane(probes, answered)
    assert reading is not None
    return reading


def test_revocation_counts_any_refusal_unless_the_worker_serves_afterwards() -> None:
    t = 100.0
    disabled = (409, "key_disabled")
    overloaded = (503, "overloaded")
    # Refused at once, with key_disabled: 0 in every measure.
    at_once = _lane(t, (0.001, *disabled))
    # A Redis failover's window: a 503 first, key_disabled half a second later. It served
    # nothing: refused from its first probe (0), and the 0.5 s wait for key_disabled is shown.
    busy = _lane(t, (0.001, *overloaded), (0.2, *overloaded), (0.5, *disabled))
    # Refused, then served: a violation, counted from its next refusal (after the served one).
    served = _lane(t, (0.001, *overloaded), (0.1, 200, ""), (0.3, *disabled))
    # Served by its first probe (counted as served after the answer, not after a refusal).
    late = _lane(t, (0.001, 200, ""), (0.05, *disabled))
    assert read_lane([], t) is None  # answered nothing: absent
    assert (at_once.refused_after, at_once.key_disabled_after) == (0.0, 0.0)
    assert not at_once.unrelated_first
    assert (busy.refused_after, busy.first_refused, busy.unrelated_first) == (0.0, True, True)
    assert busy.key_disabled_after == pytest.approx(0.5)
    assert (busy.served, busy.served_after_refusal, busy.other_refusals) == (0, False, 2)
    assert busy.refused_back == pytest.approx(0.021)  # its first probe's answer
    assert (served.served_after_refusal, served.served) == (True, 1)
    assert served.refused_after == pytest.approx(0.3)
    assert (late.served_after_refusal, late.served, late.first_refused) == (False, 1, False)
    assert late.refused_after == pytest.approx(0.05)
    # Refusing for another reason until the probes stopped: its last probe stands in.
    only_busy = _lane(t, (0.001, *overloaded), (9.9, *overloaded))
    assert only_busy.refused_after == 0.0
    assert only_busy.key_disabled_after == pytest.approx(9.9)
    # Still serving at its last probe: that probe's time.
    assert _lane(t, (0.001, 200, ""), (0.4, 200, "")).refused_after == pytest.approx(0.4)

    f = figures([at_once, busy])
    assert (f.propagation, f.first_refused, f.unrelated_first, f.lanes) == (0.0, 2, 1, 2)
    assert f.key_disabled_after == pytest.approx(0.5)
    assert (f.served_after, f.served_after_refusal, f.other_refusals) == (0, 0, 2)
    g = figures([at_once, busy, served])
    assert g.propagation == pytest.approx(0.3)
    assert (g.served_after, g.served_after_refusal) == (1, 1)

    def row(*lanes: LaneReading) -> str:
        f = figures(list(lanes))
        r = Round(
            "redis-failover",
            f.seconds,
            f.served_after,
            f.lanes,
            0,
            propagation=f.propagation,
            probe_rtt=f.probe_rtt,
            replicas=3,
            confirmed=3,
            waited=0.01,
            other_refusals=f.other_refusals,
            first_refused=f.first_refused,
            unrelated_first=f.unrelated_first,
            key_disabled_after=f.key_disabled_after,
            served_after_refusal=f.served_after_refusal,
        )
        text = render(
            title="t",
            setup={},
            phases=[],
            outcomes=[],
            rounds=[r],
            revocation_errors=[],
            integrity=Integrity(),
            final_replay=ReplayResult(),
        )
        return next(line for line in text.splitlines() if line.startswith("| all |"))

    # after the answer 0 (both refused at once); one worker first refused for another reason,
    # and it answered key_disabled 500 ms after the answer; nothing served.
    assert row(at_once, busy) == (
        "| all | 1 | 21 / 21 / 21 | 0 | 2 of 2 | 1 | 500 | 20 | 10 / 10 | 0 | 0 | 0 | 2 | 0 |"
    )
    # The worker that served after refusing: 300 ms, one encryption, one violation.
    assert row(at_once, busy, served) == (
        "| all | 1 | 320 / 320 / 320 | 300 | 3 of 3 | 2 | 500 | 20 | 10 / 10 | 0 | 1 | 1 | 3 | 0 |"
    )


def test_the_propagation_header_is_read_for_the_report() -> None:
    header = 'replicas=3, confirmed=2, waited=0.043, missing=("ab12")'
    assert parse_propagation(header) == {"replicas": 3, "confirmed": 2, "waited": 0.043}
    assert parse_propagation(None) == {}


def test_a_failover_timeline_is_read_from_the_sentinels_and_cryptd_logs(tmp_path: Path) -> None:
    """Seconds after the kill: the first +sdown / +odown / +switch-master of any Sentinel
    (local time in their logs) and each host's first "replay store answers again" (UTC)."""
    bed = Bed(tmp_path, subnet="10.9.8")
    killed = datetime.datetime(2026, 12, 5, 10, 0, 0, tzinfo=datetime.UTC).timestamp()

    def sentinel(at: float) -> str:
        return datetime.datetime.fromtimestamp(at).strftime("%d %b %Y %H:%M:%S.%f")[:-3]

    for name, offset in (("sentinel1", 0.0), ("sentinel2", 0.1), ("sentinel3", 0.2)):
        bed.directory(name).mkdir()
        (bed.directory(name) / "sentinel.log").write_text(
            f"1:X {sentinel(killed - 60)} # +sdown master cryptd 10.9.8.31 6379\n"
            f"1:X {sentinel(killed + 1.1 + offset)} # +sdown master cryptd 10.9.8.31 6379\n"
            f"1:X {sentinel(killed + 1.2 + offset)} # +odown master cryptd 10.9.8.31 6379 #q\n"
            f"1:X {sentinel(killed + 2.3 + offset)} # +switch-master cryptd 10.9.8.31 6379 x\n"
        )
    for name, offset in (("app1", 2.35), ("app2", 2.45)):
        bed.directory(name).mkdir()
        stamp = datetime.datetime.fromtimestamp(killed + offset, datetime.UTC)
        ts = stamp.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        (bed.directory(name) / "cryptd.log").write_text(
            f'{{"ts":"{ts}","level":"warning","msg":"replay store answers again (x)"}}\n'
        )
    timeline = failover_timeline(bed, killed, "redis2")  # no Redis: no epoch figure
    assert timeline == {
        "sdown_s": 1.1,
        "odown_s": 1.2,
        "switch_s": 2.3,
        "cryptd_reached_first_s": 2.35,
        "cryptd_reached_last_s": 2.45,
    }


# The real bed --------------------------------------------------------------------------


def _need_bed() -> None:
    try:
        if os.geteuid() != 0:
            raise BedError("the test bed needs root")
        check_programs()
    except BedError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the test bed is required under CI: {exc}")
        pytest.skip(str(exc))


def _isolated_bed(tmp_path: Path) -> Bed:
    """A bed of this test's own: names and a /24 no other bed on the machine uses."""
    prefix = f"ct{secrets.token_hex(2)}"
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    for _ in range(50):
        subnet = f"10.{secrets.choice(range(200, 250))}.{secrets.randbelow(256)}"
        if f" {subnet}." not in used:
            break
    # Not below tmp_path: PostgreSQL runs as its own user, who cannot enter pytest's 0700
    # directories. down() removes it.
    run_dir = Path(tempfile.mkdtemp(prefix="cryptd-bed-", dir="/tmp"))
    return Bed(run_dir, prefix, subnet)


@pytest.mark.slow
def test_the_balancers_log_explains_a_5xx_it_answered(tmp_path: Path) -> None:
    """HAProxy's httplog lines (raw format, abnormal sessions only) picked by status."""
    bed = Bed(tmp_path, subnet="10.9.8")
    bed.directory("lb").mkdir()
    shut = (
        "10.9.8.2:40112 [05/Dec/2026:23:40:01.120] cryptd hosts/app2 0/0/0/-1/812 502 209 - - "
        'SH-- 9/9/3/1/0 0/0 "POST /v1/encrypt/aes256-gcm HTTP/1.1"'
    )
    nobody = (
        "10.9.8.2:40114 [05/Dec/2026:23:40:01.300] cryptd hosts/<NOSRV> 0/-1/-1/-1/0 503 217 "
        '- - SC-- 9/9/0/0/0 0/0 "POST /v1/sign/ed25519 HTTP/1.1"'
    )
    (bed.directory("lb") / "haproxy.log").write_text(
        f"[NOTICE]   (1) : haproxy version is 2.6.12\n{shut}\n{nobody}\n"
    )
    assert lb_errors(bed, {502}) == [shut]
    assert lb_errors(bed, {502, 503}) == [shut, nobody]
    assert lb_errors(bed, {504}) == []


def test_down_cleans_up_after_a_crash(tmp_path: Path) -> None:
    """No state file, a namespace with a live process, a veth, a mount: down removes all,
    and a second down finds nothing."""
    _need_bed()
    bed = _isolated_bed(tmp_path)
    node = bed.node("app1")
    subprocess.run(["ip", "netns", "add", node.namespace], check=True)
    subprocess.run(
        ["setsid", "-f", *node.command(["sleep", "300"])], check=True, stdout=subprocess.DEVNULL
    )
    disk = bed.disk("app1")
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "x", str(disk)], check=True)
    try:
        # setsid -f returns before the process has entered the namespace: wait for it.
        wait_for("the process in the namespace", node.pids, timeout=10)
    finally:
        removed = down(bed.run_dir, bed.prefix)
    assert node.namespace in removed
    assert namespaces(bed.prefix) == []
    assert not bed.run_dir.exists()
    assert mounts_under(bed.run_dir) == []
    assert down(bed.run_dir, bed.prefix) == []


@pytest.mark.slow
def test_a_host_killed_under_load_loses_nothing_and_replays_are_refused(tmp_path: Path) -> None:
    """The CI version of the campaign: the bed up, ~10 s of mixed signed load with one cryptd
    host killed with SIGKILL and restarted, every accepted request replayed at every host,
    the bed down with nothing left behind."""
    _need_bed()
    bed = _isolated_bed(tmp_path)
    report = tmp_path / "faults.md"
    try:
        up(bed)
        assert len(namespaces(bed.prefix)) == 11
        goals = campaign(bed, ["kill-host"], Timing(1, 1, 0.5, 1, 40), threads=1, report=report)
    finally:
        down(bed.run_dir, bed.prefix)
    assert namespaces(bed.prefix) == []
    assert not bed.run_dir.exists()
    assert goals["accepted"] > 20
    assert goals == {**goals, "replays_passed": 0, "tokens_failed": 0, "keys_lost": 0}
    assert goals["revocation_served_after"] == 0
    text = report.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| kill-host | app2 |"))
    replays = row.rstrip(" |").rsplit("|", 1)[1].strip()
    sent, passed = (int(x) for x in replays.split(" / "))
    assert sent >= 3 * 20
    assert passed == 0
    assert "## Revocation across hosts" in text
