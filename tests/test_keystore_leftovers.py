"""The temporary copies of the keyring a killed writer leaves beside it: removed at start,
under the store's lock, and nothing else is."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from service.cli.serve import _remove_keyring_leftovers
from service.config import Settings
from service.keys.admin import create_keyring_file
from service.keys.filestore import FileKeyStore
from service.keys.masterkey import MasterKey

KILLED_WRITER = """
import os, sys, tempfile
from pathlib import Path
path = Path(sys.argv[1])
fd, _ = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
os.fchmod(fd, 0o600)
os.write(fd, path.read_bytes())
print("written", flush=True)
os.kill(os.getpid(), 9)
"""


def _keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    create_keyring_file(path, MasterKey(os.urandom(32)))
    return path


def test_a_killed_writers_copy_is_removed_and_nothing_else(tmp_path: Path) -> None:
    path = _keyring(tmp_path)
    # What atomic_write leaves when SIGKILLed between the temporary file and the rename.
    done = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(path)], capture_output=True, check=False
    )
    assert done.returncode == -signal.SIGKILL
    (left,) = tmp_path.glob(".keyring.json.*.tmp")
    assert left.stat().st_mode & 0o777 == 0o600
    keep = [
        tmp_path / ".clients.json.abcd1234.tmp",  # another file's temporary copy
        tmp_path / "keyring.json.lock",
        tmp_path / ".keyring.json.abcd1234.tmp.bak",
        tmp_path / "x.keyring.json.abcd1234.tmp",
    ]
    for other in keep:
        other.write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    link = tmp_path / ".keyring.json.link0000.tmp"
    link.symlink_to(outside)
    before = path.read_bytes()

    assert FileKeyStore(path).remove_leftovers() == 1
    assert not left.exists()
    assert all(other.exists() for other in keep)
    assert link.is_symlink()
    assert outside.read_bytes() == b"keep me"
    assert path.read_bytes() == before
    assert FileKeyStore(path).remove_leftovers() == 0


def test_a_writer_mid_write_is_waited_for(tmp_path: Path) -> None:
    """While a writer holds the lock its temporary file is its own: left alone until the
    writer is done."""
    path = _keyring(tmp_path)
    store = FileKeyStore(path)
    in_flight = tmp_path / ".keyring.json.inflite1.tmp"
    result: list[int] = []
    with store.transaction():
        in_flight.write_bytes(b"being written")
        sweeper = threading.Thread(target=lambda: result.append(store.remove_leftovers()))
        sweeper.start()
        time.sleep(0.3)
        assert in_flight.exists()
        assert not result
        in_flight.rename(path.with_name("renamed"))  # the writer's rename
    sweeper.join(10)
    assert result == [0]


def test_no_directory_is_nothing_to_remove(tmp_path: Path) -> None:
    assert FileKeyStore(tmp_path / "absent" / "keyring.json").remove_leftovers() == 0


def test_the_start_removes_them(tmp_path: Path) -> None:
    master = os.urandom(32)
    path = tmp_path / "keyring.json"
    create_keyring_file(path, MasterKey(master))
    left = tmp_path / ".keyring.json.k1lled00.tmp"
    left.write_bytes(path.read_bytes())
    master_file = tmp_path / "master.key"
    master_file.write_text(base64.b64encode(master).decode())
    _remove_keyring_leftovers(
        Settings(env="development", master_key_file=master_file, keyring_file=path)
    )
    assert not left.exists()
