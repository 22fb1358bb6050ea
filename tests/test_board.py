"""The host's generation board and the replicas' confirmations, without servers: a board
shared by processes only rises; a worker whose snapshot is older than the board reads the store
before it serves, and refuses (503, with Retry-After) when the store cannot bring it up to
date; a change waits for the live replicas and names the ones that did not confirm."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest

from service.api.errors import cryptd_error_response
from service.errors import KeyNotFound, KeystoreUnavailable
from service.keys.admin import initialise
from service.keys.board import SIZE, Board
from service.keys.filestore import FileKeyStore
from service.keys.lease import Lease
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.pgstore import parse_notice
from service.keys.propagation import Propagation, Replicas
from service.keys.store import Announced, Changed
from service.keys.watch import KeyringWatcher
from service.runner import CryptoRunner

MASTER = MasterKey(bytes(range(32)))


def _raise_in_child(path: str, generation: int) -> None:
    board = Board(Path(path))
    board.raise_to(generation)
    board.close()


@pytest.mark.slow
def test_a_board_is_shared_by_processes_and_never_goes_down(tmp_path: Path) -> None:
    path = tmp_path / "keyring.board"
    board = Board(path)
    assert board.generation == 0
    assert path.stat().st_size == SIZE
    assert path.stat().st_mode & 0o777 == 0o600
    child = multiprocessing.get_context("spawn").Process(
        target=_raise_in_child, args=(str(path), 41)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert board.generation == 41  # seen through the mapping, no reread
    assert board.raise_to(7) is False
    assert board.generation == 41
    assert board.raise_to(42) is True
    again = Board(path)  # another worker opening it: same cell, same replica id
    assert (again.generation, again.replica) == (42, board.replica)
    assert len(board.replica) == 32
    again.close()
    board.close()


def test_boards_of_other_hosts_have_other_replica_ids(tmp_path: Path) -> None:
    first, second = Board(tmp_path / "a"), Board(tmp_path / "b")
    assert first.replica != second.replica
    assert Board().replica not in (first.replica, second.replica)
    first.close()
    second.close()


def test_a_board_refuses_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / "keyring.board").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match=r"symbolic link|Too many levels"):
        Board(tmp_path / "keyring.board")


def _manager(tmp_path: Path, board: Board) -> KeyManager:
    store = FileKeyStore(tmp_path / "keyring.json")
    if store.read() is None:
        initialise(store, MASTER)
    manager = KeyManager(store, MASTER, board=board)
    manager.load()
    return manager


async def test_a_sibling_commit_makes_the_next_request_read_the_store(tmp_path: Path) -> None:
    board = Board(tmp_path / "keyring.board")
    committing, serving = _manager(tmp_path, board), _manager(tmp_path, Board(board.path))
    committing.create("k", "aes256-gcm", deletion_allowed=True)
    watcher = KeyringWatcher(serving, interval=3600)  # its periodic check never comes
    runner = CryptoRunner(serving, {}, chunk_size=8, watcher=watcher)
    _, key = await runner.key("k")  # a miss: looked up in the store
    assert key.name == "k"
    committing.delete("k")
    assert board.generation == committing.keyring.generation > serving.keyring.generation
    with pytest.raises(KeyNotFound):
        await runner.key("k")  # the board was ahead: the store was read before serving
    assert serving.keyring.generation == board.generation


class GatedRead:
    """A watcher's ``run_blocking`` whose store reads wait for :attr:`release` (a read that
    takes a while), counting them."""

    def __init__(self) -> None:
        self.reads = 0
        self.release = threading.Event()

    async def __call__(self, check: Callable[[], Any]) -> Any:
        self.reads += 1

        def gated() -> Any:
            self.release.wait(10)
            return check()

        return await asyncio.to_thread(gated)


async def test_a_request_behind_the_board_is_served_by_the_check_already_reading(
    tmp_path: Path,
) -> None:
    """A sibling's change raised the board and the notification's store check is reading when
    a request arrives: that check brings the change, and the request is answered after it,
    without a second full read of the store (which doubled the first request's wait)."""
    board = Board(tmp_path / "keyring.board")
    committing, serving = _manager(tmp_path, board), _manager(tmp_path, Board(board.path))
    committing.create("k", "aes256-gcm")
    serving.refresh()
    slow_read = GatedRead()

    watcher = KeyringWatcher(serving, interval=3600, run_blocking=slow_read)
    runner = CryptoRunner(serving, {}, chunk_size=8, watcher=watcher)
    committing.update("k", state="disabled")
    assert board.generation > serving.keyring.generation
    notified = asyncio.create_task(watcher.refresh())  # the notification of the change
    await asyncio.sleep(0.01)
    request = asyncio.create_task(runner.key("k"))
    await asyncio.sleep(0.01)
    slow_read.release.set()
    _, key = await asyncio.wait_for(request, 10)
    await notified
    assert key.state == "disabled"
    assert slow_read.reads == 1


async def test_a_notification_brought_by_the_check_under_way_costs_no_second_read(
    tmp_path: Path,
) -> None:
    """The notification of generation G arrives while a check that started after the commit
    is reading (a request behind the board started it): that check brings G, and the
    notification's refresh, and the host's announcement, do not wait for another read."""
    committing = _manager(tmp_path, Board(tmp_path / "one.board"))
    serving = _manager(tmp_path, Board(tmp_path / "other.board"))
    slow_read = GatedRead()

    watcher = KeyringWatcher(serving, interval=3600, run_blocking=slow_read)
    committing.create("k", "aes256-gcm")
    generation = committing.keyring.generation
    under_way = asyncio.create_task(watcher.refresh())  # started after the commit
    await asyncio.sleep(0.01)
    notified = asyncio.create_task(watcher.refresh(generation))
    await asyncio.sleep(0.01)
    slow_read.release.set()
    await asyncio.wait_for(asyncio.gather(under_way, notified), 10)
    assert serving.keyring.generation == generation
    assert slow_read.reads == 1
    await watcher.refresh(generation)  # a notification of what is already served
    assert slow_read.reads == 1
    await watcher.refresh()  # without a generation (a reconnection): the store is read
    assert slow_read.reads == 2


async def test_a_change_committed_while_a_request_waits_for_the_store_does_not_refuse_it(
    tmp_path: Path,
) -> None:
    """A request behind the board waits for the store; while it reads, a sibling commits one
    more change and raises the board again. That change is concurrent with the request: it
    is served with the generation the board had when it arrived, not refused 503 (which
    happened, now and then, to requests on hosts whose keys changed often)."""
    board = Board(tmp_path / "keyring.board")
    committing, serving = _manager(tmp_path, board), _manager(tmp_path, Board(board.path))
    committing.create("k", "aes256-gcm")
    serving.refresh()
    reads = 0

    async def read_then_sibling_commits(check: Callable[[], Any]) -> Any:
        nonlocal reads
        reads += 1

        def run() -> Any:
            result = check()
            if reads == 1:
                committing.create("other", "aes256-gcm")  # raises the board after the read
            return result

        return await asyncio.to_thread(run)

    watcher = KeyringWatcher(serving, interval=3600, run_blocking=read_then_sibling_commits)
    runner = CryptoRunner(serving, {}, chunk_size=8, watcher=watcher)
    committing.update("k", state="disabled")
    arrived_with = board.generation
    keyring, key = await runner.key("k")
    assert key.state == "disabled"  # the change acknowledged before it arrived is in force
    assert keyring.generation == arrived_with < board.generation


class _InterleavedStore(FileKeyStore):
    """The keyring file; ``before_stamp`` runs once before the next stamp is read, to put
    another writer's commit exactly between a commit and the stamp read after it."""

    before_stamp: Callable[[], object] | None = None

    def stamp(self) -> Hashable:
        hook, self.before_stamp = self.before_stamp, None
        if hook is not None:
            hook()
        return super().stamp()


def test_a_change_committed_right_after_ours_is_still_loaded(tmp_path: Path) -> None:
    """Worker A commits; before it reads the store's stamp, worker B commits too. A stamp
    of B's change kept beside A's snapshot made A's checks skip reading the store: A stayed
    one change behind, answering 503 while the board was ahead, until the next change or the
    60 s full check (seen on the test bed under key-management load)."""
    path = tmp_path / "keyring.json"
    initialise(FileKeyStore(path), MASTER)
    a = KeyManager(_InterleavedStore(path), MASTER, board=Board(tmp_path / "a.board"))
    b = KeyManager(FileKeyStore(path), MASTER, board=Board(tmp_path / "b.board"))
    a.load()
    b.load()
    store = a.store
    assert isinstance(store, _InterleavedStore)
    store.before_stamp = lambda: b.create("from-b", "aes256-gcm")
    a.create("from-a", "aes256-gcm")
    assert "from-b" not in a.keyring
    a.refresh()  # a notification's check, or the periodic one
    assert "from-b" in a.keyring
    assert a.keyring.generation == b.keyring.generation


async def test_a_board_ahead_of_the_store_is_refused_not_served(tmp_path: Path) -> None:
    """The store gave back an older keyring than a change acknowledged here (a failover that
    lost it): nothing is served from the older one."""
    board = Board(tmp_path / "keyring.board")
    manager = _manager(tmp_path, board)
    manager.create("k", "aes256-gcm")
    board.raise_to(manager.keyring.generation + 5)
    runner = CryptoRunner(manager, {}, chunk_size=8, watcher=KeyringWatcher(manager, interval=3600))
    with pytest.raises(KeystoreUnavailable, match="in force on this host") as refused:
        await runner.key("k")
    response = cryptd_error_response(refused.value)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    with pytest.raises(KeystoreUnavailable):
        manager.backup("k")  # nor exported


async def test_a_sibling_commit_during_a_store_check_is_no_reason_to_refuse(
    tmp_path: Path,
) -> None:
    """A sibling commits (and raises the board) while this worker's check reads the store, for
    a name it does not know or because the board was ahead: that change is concurrent with
    the request, which is answered from what the read brought (404, or the key), not 503 as
    if the store had lost an acknowledged change (seen as 503 keystore_unavailable for a
    destroyed key's 404, and for a key created just before)."""
    board = Board(tmp_path / "keyring.board")
    sibling, serving = _manager(tmp_path, board), _manager(tmp_path, Board(board.path))
    names = (f"during-{n}" for n in itertools.count())

    async def read_then_sibling_commits(call: Callable[[], object]) -> object:
        done = await asyncio.to_thread(call)  # this worker's check has read the store...
        sibling.create(next(names), "aes256-gcm")  # ...then a sibling commits
        return done

    watcher = KeyringWatcher(serving, interval=3600, run_blocking=read_then_sibling_commits)
    runner = CryptoRunner(serving, {}, chunk_size=8, watcher=watcher)
    with pytest.raises(KeyNotFound):
        await runner.key("unknown")  # a miss
    assert board.generation > serving.keyring.generation
    _, key = await runner.key("during-0")  # the board was ahead: read, and a commit meanwhile
    assert key.name == "during-0"
    assert board.generation > serving.keyring.generation
    # The next request reads the store again: what was committed meanwhile is served then.
    _, key = await runner.key("during-1")
    assert key.name == "during-1"


async def test_a_change_waits_for_the_live_replicas_and_names_the_late() -> None:
    now = [100.0]
    replicas = Replicas(Board(), live_for=6.0, clock=lambda: now[0])
    alone = await replicas.confirm(5, timeout=1.0)
    assert (alone.replicas, alone.confirmed, alone.missing) == (1, 1, ())
    assert alone.waited < 0.01
    replicas.heard("b" * 32, 4)
    replicas.heard("c" * 32, 5)

    async def answer_later() -> None:
        await asyncio.sleep(0.05)
        replicas.heard("b" * 32, 5)

    task = asyncio.create_task(answer_later())
    confirmed = await replicas.confirm(5, timeout=5.0)
    await task
    assert (confirmed.replicas, confirmed.confirmed, confirmed.missing) == (3, 3, ())
    assert 0.04 < confirmed.waited < 1.0
    report = Propagation(replicas=3, confirmed=3, waited=0.0123)
    assert report.header() == "replicas=3, confirmed=3, waited=0.012"

    replicas.heard("b" * 32, 5)
    timed_out = await replicas.confirm(6, timeout=0.05)
    assert (timed_out.replicas, timed_out.confirmed) == (3, 1)  # this one
    assert timed_out.missing == ("b" * 32, "c" * 32)
    assert timed_out.header().endswith(f'missing=("{"b" * 32}" "{"c" * 32}")')
    now[0] += 6.5  # three heartbeats without a word from either: forgotten
    assert (await replicas.confirm(6, timeout=1.0)).replicas == 1
    replicas.heard(replicas.me, 1)  # its own announcements are not another replica
    assert replicas.live() == {}


def test_notifications_are_parsed_and_anything_else_ignored() -> None:
    assert parse_notice("cryptd_keyring", "17") == Changed(17)
    assert parse_notice("cryptd_keyring", "") == Changed(None)
    assert parse_notice("cryptd_replicas", "ab" * 16 + " 17") == Announced("ab" * 16, 17)
    for payload in ("ab" * 16, "xy" * 16 + " 3", "ab" * 16 + " -3", "ab" * 17 + " 3", ""):
        assert parse_notice("cryptd_replicas", payload) is None
    assert parse_notice("other", "17") is None


async def _until(condition: Callable[[], bool], seconds: float) -> None:
    for _ in range(int(seconds / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not in time")


class ChannelStore(FileKeyStore):
    """A file store with a channel the test feeds, recording the announcements made on it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.queue: asyncio.Queue[Changed | Announced] = asyncio.Queue()
        self.announced: list[int] = []

    def notifications(self) -> Any:
        async def stream() -> Any:
            while True:
                yield await self.queue.get()

        return stream()

    def announce(self, replica: str, generation: int) -> None:
        self.announced.append(generation)


async def test_an_announcement_is_heard_while_the_change_before_it_is_being_loaded(
    tmp_path: Path,
) -> None:
    """The notification of a change starts a store check that takes a while; another
    replica's announcement arriving meanwhile is heard at once, not after that check (a
    committing worker's answer waits for exactly such announcements, and its own change's
    notification starts a check on it too)."""
    committing = _manager(tmp_path, Board(tmp_path / "one.board"))
    store = ChannelStore(tmp_path / "keyring.json")
    serving = KeyManager(store, MASTER, board=Board(tmp_path / "other.board"))
    serving.load()
    release = threading.Event()

    async def run_blocking(call: Callable[[], Any]) -> Any:
        def gated() -> Any:
            release.wait(10)
            return call()

        return await asyncio.to_thread(gated if call == serving.refresh else call)

    watcher = KeyringWatcher(serving, interval=3600, run_blocking=run_blocking, heartbeat=3600)
    watcher.start()
    try:
        committing.create("k", "aes256-gcm")
        generation = committing.keyring.generation
        await store.queue.put(Changed(generation, frozenset({"k"})))
        await store.queue.put(Announced("b" * 32, generation))
        await _until(lambda: watcher.replicas.live() == {"b" * 32: generation}, 5)
        assert serving.keyring.generation < generation  # still loading the change
        release.set()
        await _until(lambda: generation in store.announced, 10)
        assert serving.keyring.generation == generation
    finally:
        release.set()
        await watcher.close()


async def test_a_change_waits_for_its_own_notification_first() -> None:
    """Announcements committed before the change reach the listener before the change's own
    notification: until that arrives, the live replicas are not known for sure."""
    replicas = Replicas(Board(), live_for=6.0)
    replicas.listening = True
    replicas.changed(4)

    async def notified_later() -> None:
        await asyncio.sleep(0.05)
        replicas.heard("b" * 32, 5)  # announced before the change committed, heard first
        replicas.changed(5)

    task = asyncio.create_task(notified_later())
    report = await replicas.confirm(5, timeout=5.0)
    await task
    assert (report.replicas, report.confirmed) == (2, 2)
    assert 0.04 < report.waited < 1.0
    unheard = await replicas.confirm(6, timeout=0.05)  # never notified: nobody confirmed
    assert (unheard.replicas, unheard.confirmed, unheard.missing) == (2, 1, ("b" * 32,))


async def test_a_silent_replica_is_waited_for_until_it_is_no_longer_live() -> None:
    """Its lease has run out by then: the answer may leave without it, and says it complete."""
    replicas = Replicas(Board(), live_for=0.2)
    replicas.heard("b" * 32, 4)
    report = await replicas.confirm(5, timeout=5.0)
    assert (report.replicas, report.confirmed, report.missing) == (1, 1, ())
    assert 0.15 < report.waited < 1.0


def held(lease: Lease) -> bool:
    return lease.held  # read anew each time (a timer turns it off)


async def test_the_lease_runs_out_unless_extended() -> None:
    loop = asyncio.get_running_loop()
    lease = Lease(duration=0.1)
    assert held(lease)  # no other replica: held for good
    lease.require()
    assert not held(lease)
    assert not lease.holds_at(loop.time())
    lease.extend(loop.time())
    assert held(lease)
    await asyncio.sleep(0.06)
    lease.extend(loop.time())  # extended before it ran out: held on
    await asyncio.sleep(0.06)
    assert held(lease)
    await asyncio.sleep(0.1)
    assert not held(lease)
    assert lease.holds_at(lease.until - 0.01)
    lease.extend(loop.time() - 1.0)  # an announcement older than the lease: changes nothing
    assert not held(lease)
    lease.close()
