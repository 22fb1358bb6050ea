"""The host-local replay store (LMDB): semantics, sharing between processes, expiry, the size
bound, a writer killed mid-transaction, the epoch, and the private directory. Real files,
real processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import stat
import time
from multiprocessing.queues import Queue
from pathlib import Path

import lmdb
import pytest

from service.auth import replay_host
from service.auth.ratelimit_host import HostRateLimiter
from service.auth.replay import StoreRecovering, StoreUnavailable
from service.auth.replay_host import (
    BUCKET_SECONDS,
    SLOTS,
    SUBDIRECTORY,
    HostReplayStore,
    ReplayStoreError,
)
from service.errors import RateLimited

NOW = 1_800_000_000


def _store(directory: Path, **options: int) -> HostReplayStore:
    # epoch 0: a store that can accept at once (the start-up window is tested on its own).
    return HostReplayStore(directory, epoch=options.pop("epoch", 0), **options)


def test_first_time_then_replay(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.remember_now("a", "n1", NOW, NOW)
    assert not store.remember_now("a", "n1", NOW, NOW + 5)
    assert store.remember_now("b", "n1", NOW, NOW + 5)  # pairs, not nonces alone
    assert store.remember_now("a", "n2", NOW, NOW + 5)
    assert len(store) == 3
    store.close()


def test_remembered_across_reopen(tmp_path: Path) -> None:
    """A restarted server (every worker gone, the file kept) still refuses the replay."""
    store = _store(tmp_path)
    assert store.remember_now("a", "n1", NOW, NOW)
    store.close()
    again = HostReplayStore(tmp_path)  # no epoch given: the stored one (0) stays
    assert again.epoch == 0
    assert not again.remember_now("a", "n1", NOW, NOW + 1)
    again.close()


def _contend(
    directory: str, worker: int, nonces: int, results: Queue[tuple[int, list[int]]]
) -> None:
    store = HostReplayStore(Path(directory))
    accepted = [n for n in range(nonces) if store.remember_now("app", f"n{n}", NOW, NOW)]
    results.put((worker, accepted))
    store.close()


@pytest.mark.slow
def test_processes_share_one_store_and_each_nonce_is_accepted_once(tmp_path: Path) -> None:
    _store(tmp_path).close()
    context = multiprocessing.get_context("spawn")
    results: Queue[tuple[int, list[int]]] = context.Queue()
    nonces = 4000
    processes = [
        context.Process(target=_contend, args=(str(tmp_path), w, nonces, results)) for w in range(3)
    ]
    for process in processes:
        process.start()
    accepted = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    everything = sorted(n for _, mine in accepted for n in mine)
    assert everything == list(range(nonces))  # each nonce exactly once, whoever saw it first


def test_an_expired_minute_is_emptied_and_its_slot_reused(tmp_path: Path) -> None:
    store = _store(tmp_path, max_age=300)
    for n in range(100):
        assert store.remember_now("a", f"old{n}", NOW, NOW)
    assert store.remember_now("a", "recent", NOW + 200, NOW + 200)
    # The sweep (every few seconds per process) empties minutes no signature can still cover.
    store._next_sweep = 0.0
    assert store.remember_now("a", "later", NOW + 200, NOW + 300)
    assert len(store) == 102  # the first minute is still within the 300 s window
    store._next_sweep = 0.0
    assert store.remember_now("a", "much-later", NOW + 500, NOW + 500)
    assert len(store) == 3  # NOW's minute has expired: gone
    store.close()


def test_a_slot_meeting_a_minute_of_the_next_lap_is_emptied_first(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.remember_now("a", "n1", NOW, NOW)  # this first call sweeps (nothing to do)
    wrap = NOW + SLOTS * BUCKET_SECONDS  # the same slot, SLOTS minutes on; no sweep due yet
    assert store.remember_now("a", "n2", wrap, wrap)
    assert len(store) == 1  # NOW's minute made room for the new one
    assert store.remember_now("a", "n1", wrap, wrap)  # (a created this old is stale anyway)
    with pytest.raises(StoreUnavailable):  # and one older than the ring is never accepted
        store.remember_now("a", "n3", NOW, wrap)
    store.close()


def test_a_full_store_refuses_instead_of_forgetting(tmp_path: Path) -> None:
    store = _store(tmp_path, max_bytes=1024 * 1024)
    accepted = 0
    try:
        while store.remember_now("a", f"n{accepted}", NOW, NOW):
            accepted += 1
    except StoreUnavailable as exc:
        refusal = str(exc)
    assert refusal == "replay store full"
    assert accepted > 10_000  # ~39 bytes a nonce
    assert not store.remember_now("a", "n0", NOW, NOW)  # everything accepted is still known
    assert not store.remember_now("a", f"n{accepted - 1}", NOW, NOW)
    # Room again once that minute expires.
    store._next_sweep = 0.0
    assert store.remember_now("a", "fresh", NOW + 400, NOW + 400)
    store.close()


async def test_nonces_of_one_loop_iteration_share_one_transaction_each_with_its_answer(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, epoch=NOW, max_skew=5)
    assert await store.remember("a", "before", NOW + 5, 300)  # a batch of its own
    batches = store._batcher.batches
    calls = [
        store.remember("a", "n1", NOW + 5, 300),
        store.remember("a", "n1", NOW + 5, 300),  # the replay of the one just before
        store.remember("a", "before", NOW + 5, 300),  # the replay of an earlier batch's
        store.remember("b", "n1", NOW + 5, 300),  # another client's nonce
        store.remember("a", "early", NOW + 2, 300),  # created before epoch + skew
        store.remember("a", "n2", NOW + 6, 300),
    ]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    assert store._batcher.batches == batches + 1
    assert answers[:4] == [True, False, False, True]
    assert isinstance(answers[4], StoreRecovering)
    assert answers[4].retry_after == 3
    assert answers[5] is True
    # What a batch remembered is remembered: a later batch refuses it, whichever process asks.
    assert not store.remember_now("a", "n2", NOW + 6, NOW + 6)
    assert not await store.remember("a", "n1", NOW + 5, 300)
    store.close()


async def test_a_store_that_cannot_write_refuses_every_nonce_of_the_batch(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, max_bytes=1024 * 1024)
    accepted = 0
    try:
        while store.remember_now("a", f"n{accepted}", NOW, NOW):
            accepted += 1
    except StoreUnavailable:
        pass
    assert accepted > 10_000
    answers = await asyncio.gather(
        *(store.remember("a", f"late{i}", NOW, 300) for i in range(5)), return_exceptions=True
    )
    assert [str(answer) for answer in answers] == ["replay store full"] * 5
    assert all(isinstance(answer, StoreUnavailable) for answer in answers)
    store.close()


def test_a_store_answers_in_every_event_loop_it_is_used_in(tmp_path: Path) -> None:
    store = _store(tmp_path)

    async def two(name: str) -> list[bool]:
        return list(
            await asyncio.gather(
                store.remember("a", name, NOW, 300), store.remember("a", name, NOW, 300)
            )
        )

    assert asyncio.run(two("n1")) == [True, False]
    assert asyncio.run(two("n2")) == [True, False]  # a new loop, a new batch
    assert asyncio.run(two("n1")) == [False, False]
    store.close()


def _die_mid_write(directory: str) -> None:
    store = HostReplayStore(Path(directory))
    txn = store._env.begin(write=True)  # holds the writer lock of every process
    txn.put(b"x" * 16, b"", db=store._slots[0])
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_worker_killed_mid_write_leaves_the_store_usable(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.remember_now("a", "before", NOW, NOW)
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=_die_mid_write, args=(str(tmp_path),))
    process.start()
    process.join(timeout=60)
    assert process.exitcode == -signal.SIGKILL
    # The lock it held is taken over (robust mutex); its uncommitted write is not there.
    started = time.monotonic()
    assert store.remember_now("a", "after", NOW, NOW)
    assert time.monotonic() - started < 1
    assert not store.remember_now("a", "before", NOW, NOW)
    with store._env.begin() as txn:
        assert txn.get(b"x" * 16, db=store._slots[0]) is None
    store.close()


def test_a_new_store_refuses_what_was_signed_before_it_started(tmp_path: Path) -> None:
    started = time.time()
    store = HostReplayStore(tmp_path, max_skew=5)
    epoch = store.epoch
    assert started <= epoch <= started + 1.01
    with pytest.raises(StoreRecovering) as refused:
        store.remember_now("a", "n", int(started), started)
    assert refused.value.retry_after == epoch + 5 - int(started)
    with pytest.raises(StoreRecovering):
        store.remember_now("a", "n", epoch + 4, started)
    assert store.remember_now("a", "n", epoch + 5, started)


async def test_readiness_waits_for_the_start_up_window(tmp_path: Path) -> None:
    store = HostReplayStore(tmp_path, max_skew=1)
    assert not await store.ping()
    deadline = time.monotonic() + 5
    while not await store.ping():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert time.time() >= store.epoch + 1
    await store.aclose()


def test_a_reboot_starts_a_new_store_with_a_new_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)
    assert store.remember_now("a", "n1", NOW, NOW)
    old = store.path
    store.close()
    # A reboot cannot happen inside a test: a new boot id stands for it.
    monkeypatch.setattr(replay_host, "boot_id", lambda: "another-boot")
    after = HostReplayStore(tmp_path)
    assert after.path.name == "another-boot.lmdb"
    assert not old.exists()
    assert not Path(f"{old}-lock").exists()
    assert after.epoch >= int(time.time())  # not the old 0: unsynchronised writes may be lost
    after.close()


def test_another_layout_is_cleared_and_gets_a_new_epoch(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.remember_now("a", "n1", NOW, NOW)
    with store._env.begin(write=True) as txn:
        txn.put(b"format", b"cryptd-replay 0", db=store._meta)
    store.close()
    again = HostReplayStore(tmp_path)
    assert again.epoch >= int(time.time())
    assert len(again) == 0
    again.close()


def test_files_are_private(tmp_path: Path) -> None:
    store = _store(tmp_path / "new")
    directory = tmp_path / "new" / SUBDIRECTORY
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    store.close()


def test_an_open_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / SUBDIRECTORY
    directory.mkdir(mode=0o700)
    directory.chmod(0o755)
    with pytest.raises(ReplayStoreError, match="open to other users"):
        HostReplayStore(tmp_path)


def test_a_world_writable_parent_is_fine(tmp_path: Path) -> None:
    # A Kubernetes emptyDir is mode 0777: the private subdirectory is what protects the file.
    tmp_path.chmod(0o777)
    store = _store(tmp_path)
    assert store.remember_now("a", "n", NOW, NOW)
    store.close()


def test_a_symlink_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    base = tmp_path / "base"
    base.mkdir()
    (base / SUBDIRECTORY).symlink_to(elsewhere)
    with pytest.raises(ReplayStoreError, match="not a directory"):
        HostReplayStore(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the directory to someone else")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / SUBDIRECTORY
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(ReplayStoreError, match="another user"):
        HostReplayStore(tmp_path)


def test_an_unwritable_place_is_refused_with_its_reason(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ReplayStoreError, match="replay store directory"):
        HostReplayStore(blocker / "below")


def test_lmdb_version_has_robust_locks() -> None:
    # The writer-takeover above relies on LMDB 0.9.17+ robust mutexes (bundled with lmdb).
    assert lmdb.version() >= (0, 9, 17)


def _drain(directory: str, results: Queue[int]) -> None:
    limiter = HostRateLimiter(Path(directory), rate=0.001, burst=50)
    allowed = 0
    for _ in range(40):
        try:
            limiter.acquire_now("app", time.monotonic())
            allowed += 1
        except RateLimited:
            pass
    results.put(allowed)


@pytest.mark.slow
def test_rate_limit_buckets_are_shared_by_the_processes_of_the_host(tmp_path: Path) -> None:
    """Three processes drawing 40 tokens each from one bucket of 50: 50 in all, not 120."""
    context = multiprocessing.get_context("spawn")
    results: Queue[int] = context.Queue()
    processes = [context.Process(target=_drain, args=(str(tmp_path), results)) for _ in range(3)]
    for process in processes:
        process.start()
    allowed = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    assert sum(allowed) == 50
    limiter = HostRateLimiter(tmp_path, rate=1000, burst=1)
    limiter.acquire_now("other", 100.0)
    with pytest.raises(RateLimited) as refused:
        limiter.acquire_now("other", 100.0)
    assert refused.value.retry_after == pytest.approx(0.001)
    limiter.acquire_now("other", 100.002)  # refilled
    # The replay store's file and this one live side by side, neither removing the other.
    store = _store(tmp_path)
    assert sorted(p.name.split(".", 1)[1] for p in store.path.parent.iterdir()) == [
        "lmdb",
        "lmdb-lock",
        "ratelimit.lmdb",
        "ratelimit.lmdb-lock",
    ]
    store.close()
