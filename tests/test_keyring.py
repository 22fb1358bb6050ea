"""Keyring behaviour that needs no server: activation delay of new versions, name rules."""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from service.errors import Conflict, InvalidRequest
from service.keys.admin import create_keyring_file
from service.keys.filestore import FileKeyStore
from service.keys.keyring import check_key_name
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey


def manager(tmp_path: Path, delay: float) -> KeyManager:
    master = MasterKey(os.urandom(32))
    path = tmp_path / "keyring.json"
    if not path.exists():
        create_keyring_file(path, master)
        writer = KeyManager(FileKeyStore(path), master)
        writer.load()
        writer.create("k", "aes256-gcm")
        writer.rotate("k")
    reader = KeyManager(FileKeyStore(path), master, activation_delay=delay)
    reader.load()
    return reader


def test_new_version_waits_for_the_activation_delay(tmp_path: Path) -> None:
    key = manager(tmp_path, delay=120).keyring.key("k")
    created = key.versions[2].created_ts
    assert key.latest_version == 2
    assert key.active_version(now=created + 10) == 1  # replicas may not have v2 yet
    assert key.active_version(now=created + 121) == 2
    assert key.version(None).version == 1
    assert key.version(2).version == 2  # decryption and explicit requests take any version


def test_without_delay_the_latest_version_is_active(tmp_path: Path) -> None:
    key = manager(tmp_path, delay=0).keyring.key("k")
    assert key.active_version() == 2


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a b", "é", "x" * 129, "a\x00"])
def test_invalid_key_names(name: str) -> None:
    with pytest.raises(InvalidRequest):
        check_key_name(name)


@pytest.mark.parametrize("name", ["a", "A-b_c.d", "x" * 128, "..."])
def test_valid_key_names(name: str) -> None:
    assert check_key_name(name) == name


# The manager over the file store ----------------------------------------------------------


def fresh(tmp_path: Path, **options: object) -> tuple[KeyManager, MasterKey, Path]:
    master = MasterKey(os.urandom(32))
    path = tmp_path / "ring.json"
    create_keyring_file(path, master)
    manager = KeyManager(FileKeyStore(path), master, **options)  # type: ignore[arg-type]
    manager.load()
    return manager, master, path


def test_every_change_raises_the_generation_and_a_no_op_writes_nothing(tmp_path: Path) -> None:
    manager, master, path = fresh(tmp_path)
    assert manager.keyring.generation == 1
    manager.create("k", "aes256-gcm")
    manager.rotate("k")
    assert manager.keyring.generation == 3
    before = path.read_bytes()
    assert manager.ensure_internal_key("cryptd:wrap", "aes256-gcm") is not None
    assert manager.keyring.generation == 4
    again = manager.ensure_internal_key("cryptd:wrap", "aes256-gcm")
    assert manager.keyring.generation == 4
    assert again is manager.keyring.internal["cryptd:wrap"]
    assert path.read_bytes() != before
    # Internal keys are neither listed nor reachable by name.
    assert "cryptd:wrap" not in manager.keyring
    with pytest.raises(InvalidRequest):
        manager.keyring.key("cryptd:wrap")
    other = KeyManager(FileKeyStore(path), master)
    assert "cryptd:wrap" in other.load().internal


def test_an_older_copy_of_the_file_is_refused_while_running(tmp_path: Path) -> None:
    manager, master, path = fresh(tmp_path)
    manager.create("k", "aes256-gcm")
    old = path.read_bytes()
    manager.rotate("k")
    served = manager.keyring
    path.write_bytes(old)
    assert manager.refresh(force=True) is False
    assert manager.keyring is served
    assert "went back" in (manager.last_reload_error or "")
    # A process starting afresh accepts it (it has no memory of generations).
    assert KeyManager(FileKeyStore(path), master).load()["k"].latest_version == 1


def test_export_and_import_of_one_key(tmp_path: Path) -> None:
    manager, _, _ = fresh(tmp_path)
    manager.create("src", "ed25519", deletion_allowed=True)
    manager.rotate("src")
    manager.update("src", min_decryption_version=2)
    exported = manager.export_key("src")
    assert "material" not in repr(exported)
    assert "versions" not in repr(exported)
    with pytest.raises(TypeError):
        pickle.dumps(exported)
    with pytest.raises(Conflict):
        manager.import_key(exported)
    copy = manager.import_key(exported, "copy")
    original = manager.keyring["src"]
    assert copy.min_decryption_version == 2
    assert copy.deletion_allowed
    assert sorted(copy.versions) == [1, 2]
    for number in (1, 2):
        assert copy.versions[number].created_at == original.versions[number].created_at
        assert copy.versions[number].handle.public_key_pem() == (
            original.versions[number].handle.public_key_pem()
        )
        assert copy.versions[number].wrapped != original.versions[number].wrapped  # new place


def test_auto_rotate_period_bounds(tmp_path: Path) -> None:
    manager, _, _ = fresh(tmp_path)
    for period in (1, 3599, -1):
        with pytest.raises(InvalidRequest):
            manager.create(f"p{period}", "aes256-gcm", auto_rotate_period=period)
    key = manager.create("hourly", "aes256-gcm", auto_rotate_period=3600)
    assert key.metadata()["auto_rotate_period"] == 3600
    assert manager.update("hourly", auto_rotate_period=0).auto_rotate_period == 0


@pytest.mark.slow
def test_due_keys_rotate_once_and_the_activation_delay_holds(tmp_path: Path) -> None:
    manager, master, path = fresh(tmp_path, min_auto_rotate_period=1, activation_delay=600)
    # Versions are dated in whole seconds (rounded down), so a version made at x.999 s is due a
    # period after x: with a period of 1 s the new version could be due again a millisecond
    # later. With 2 s it is due no sooner than a second after it was made.
    manager.create("k", "aes256-gcm", auto_rotate_period=2)
    second = KeyManager(FileKeyStore(path), master, min_auto_rotate_period=1)
    second.load()
    time.sleep(2.1)
    assert manager.due_for_rotation() == ["k"]
    # Two processes find it due; the second's transaction sees the first's rotation.
    assert manager.rotate_due() == [("k", 2)]
    assert second.rotate_due() == []
    assert second.keyring["k"].latest_version == 2
    # The new version exists, and new encryptions wait for the activation delay.
    assert manager.keyring["k"].latest_version == 2
    assert manager.keyring["k"].active_version() == 1


@pytest.mark.slow
def test_a_rotation_lock_held_elsewhere_skips_the_round(tmp_path: Path) -> None:
    manager, _, _ = fresh(tmp_path, min_auto_rotate_period=1)
    manager.create("k", "aes256-gcm", auto_rotate_period=1)
    time.sleep(2.1)
    with manager.store.try_lock("rotate") as held:
        assert held
        assert manager.rotate_due() == []  # another process holds the lock
    assert manager.rotate_due() == [("k", 2)]


async def test_a_miss_looks_in_the_store_once_and_finds_the_new_key(tmp_path: Path) -> None:
    from service.keys.watch import KeyringWatcher

    reader, master, path = fresh(tmp_path)
    writer = KeyManager(FileKeyStore(path), master)
    writer.load()
    calls = 0
    original = reader.refresh

    def counting(*, force: bool = False) -> bool:
        nonlocal calls
        calls += 1
        return original(force=force)

    reader.refresh = counting
    watcher = KeyringWatcher(reader, interval=3600)
    writer.create("late", "aes256-gcm")
    assert "late" not in reader.keyring
    # Twenty concurrent misses share one store check.
    await asyncio.gather(*(watcher.after_miss(watcher.now()) for _ in range(20)))
    assert "late" in reader.keyring
    assert calls == 1
    # Misses right after are rate-limited: one more check for a burst of them.
    started = time.monotonic()
    await asyncio.gather(*(watcher.after_miss(watcher.now()) for _ in range(20)))
    assert calls == 2
    assert time.monotonic() - started < 1.0


@pytest.mark.timeout(20)
async def test_a_check_that_finished_before_its_callbacks_ran_does_not_block_the_loop(
    tmp_path: Path,
) -> None:
    """A check can be done while its done callback still waits in the loop's queue (the
    refresh thread finished; a notification or a miss arrives in the same loop iteration).
    Awaiting it then returns without yielding: the caller must settle the check itself, or it
    spins on the loop and the worker answers nothing more."""
    from service.keys.watch import KeyringWatcher

    reader, master, path = fresh(tmp_path)
    writer = KeyManager(FileKeyStore(path), master)
    writer.load()
    checks = 0

    def already_done(refresh: Callable[[], bool]) -> asyncio.Future[bool]:
        # Completed before anyone awaits it: its callbacks are only scheduled.
        nonlocal checks
        checks += 1
        future = asyncio.get_running_loop().create_future()
        future.set_result(refresh())
        return future

    watcher = KeyringWatcher(reader, interval=3600, run_blocking=already_done)
    writer.create("late", "aes256-gcm")
    await watcher.refresh()
    assert "late" in reader.keyring
    writer.create("later", "aes256-gcm")
    await watcher.after_miss(watcher.now())
    assert "later" in reader.keyring
    assert checks == 2
