"""Master-key rotation under the Shamir seal: a new split of a new master key, same N and K.

The seal file holds only public facts and keys wrapped under other master keys, never one a
file alone opens:

- ``handover``: the new key wrapped under the previous one, so every process still holding
  the previous key (other workers, pool processes, replicas sharing the file) finds the new
  one by the id the store names and moves to it without shares. The rotating command removes
  it after ``--handover-seconds``; should it not (killed), it is ignored once ``expires`` has
  passed and removed at the next start or rotation, so the old shares stop leading to the
  new key;
- ``retired``: each replaced split's identifier (a share of it is refused with the reason)
  and its key wrapped under its successor, so backups made before a rotation still restore.

The staging steps are those of service/seal/rotation.py: ``<seal file>.next`` holds the new
split's document until the store is rewrapped, then replaces the seal file. The new shares
(``shares``, set by :meth:`ShamirKeyFiles.stage`) exist only in memory, for the command to
print once.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from service.fileio import atomic_write
from service.keys.masterkey import MasterKey
from service.seal.base import SealError
from service.seal.shamir import new_split

HANDOVER_SECONDS = 120.0  # the default: long enough for every replica to see the store change


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShamirKeyFiles:
    """The Shamir seal's file and its staged successor, and the master keys this process
    holds (``known``: the one its shares rebuilt, and those found from it)."""

    def __init__(self, path: Path, known: bytes | None = None) -> None:
        self.path = path.resolve()
        self.staged = self.path.with_name(self.path.name + ".next")
        self.retired = self.path  # retired keys are kept (wrapped) in the seal file itself
        self._known: dict[str, bytes] = {}
        self.handover_seconds = HANDOVER_SECONDS
        self.shares: list[str] = []  # the new split's mnemonics after stage(), shown once
        # Called with them once staged, before the store is rewrapped (the command prints).
        self.on_staged: Callable[[list[str]], None] | None = None
        if known is not None:
            self.learn(known)

    def learn(self, key: bytes) -> MasterKey:
        master = MasterKey(key)
        self._known[master.key_id] = key
        return master

    @staticmethod
    def _document(path: Path) -> dict[str, Any] | None:
        try:
            raw = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        return raw if isinstance(raw, dict) and isinstance(raw.get("key_id"), str) else None

    def _key_id(self, path: Path) -> str | None:
        document = self._document(path)
        return None if document is None else str(document["key_id"])

    def staged_key_id(self) -> str | None:
        return self._key_id(self.staged)

    def current_key_id(self) -> str | None:
        return self._key_id(self.path)

    def current(self) -> MasterKey:
        key_id = self.current_key_id()
        if key_id is None or key_id not in self._known:
            raise SealError(f"the master key of the Shamir seal {self.path} is not unsealed here")
        return MasterKey(self._known[key_id])

    def _unwrap(self, under: object, blob: object, key_id: str) -> MasterKey | None:
        holder = self._known.get(under) if isinstance(under, str) else None
        if holder is None or not isinstance(blob, str):
            return None
        try:
            raw = MasterKey(holder).unwrap_master(base64.b64decode(blob, validate=True), key_id)
        except (binascii.Error, ValueError):
            return None
        return None if raw is None else self.learn(raw)

    def find(self, key_id: str) -> MasterKey | None:
        if key_id in self._known:
            return MasterKey(self._known[key_id])
        for candidate in (self.staged, self.path):  # staged first, as the other seals
            document = self._document(candidate)
            handover = None if document is None else document.get("handover")
            if document is None or document["key_id"] != key_id or not isinstance(handover, dict):
                continue
            if not isinstance(handover.get("expires"), float | int) or (
                handover["expires"] < time.time()
            ):
                continue
            found = self._unwrap(handover.get("from"), handover.get("wrapped"), key_id)
            if found is not None:
                return found
        return None

    def find_retired(self, key_id: str) -> MasterKey | None:
        document = self._document(self.path)
        entries = [e for e in (document or {}).get("retired", ()) if isinstance(e, dict)]
        # Each retired key is wrapped under its successor: walk back from the keys known.
        progress = True
        while key_id not in self._known and progress:
            progress = False
            for entry in entries:
                wanted = entry.get("key_id")
                if isinstance(wanted, str) and wanted not in self._known:
                    progress |= (
                        self._unwrap(entry.get("under"), entry.get("wrapped"), wanted) is not None
                    )
        return MasterKey(self._known[key_id]) if key_id in self._known else None

    def stage(self, key: bytes) -> None:
        """Write ``<seal file>.next``: a new split of ``key`` with the current N and K, the
        hand-over from the current key, the current split retired; keep the shares."""
        current = self._document(self.path)
        if current is None:
            raise SealError(f"{self.path} is not a Shamir seal")
        old_id = str(current["key_id"])
        old = self._known.get(old_id)
        if old is None:
            raise SealError(f"the master key of the Shamir seal {self.path} is not unsealed here")
        new = MasterKey(key)
        retired = [e for e in current.get("retired", ()) if isinstance(e, dict)]
        retired.append(
            {
                "identifier": int(current["identifier"]),
                "key_id": old_id,
                "under": new.key_id,
                "wrapped": base64.b64encode(new.wrap_master(old)).decode(),
                "rotated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
        )
        used = frozenset(int(e["identifier"]) for e in retired)
        shares, document = new_split(
            int(current["shares"]), int(current["threshold"]), key, avoid=used
        )
        document["handover"] = {
            "from": old_id,
            "wrapped": base64.b64encode(MasterKey(old).wrap_master(key)).decode(),
            "expires": time.time() + self.handover_seconds,
        }
        document["retired"] = retired
        atomic_write(self.staged, orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
        self.learn(key)
        self.shares = shares
        if self.on_staged is not None:
            self.on_staged(shares)

    def promote(self) -> None:
        os.replace(self.staged, self.path)
        _fsync_directory(self.path.parent)

    def discard_staged(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.staged.unlink()
            _fsync_directory(self.path.parent)

    def drop_expired_handover(self) -> bool:
        """Remove a hand-over whose time has passed (the caller holds the rotation lock)."""
        return self.drop_handover(expired_only=True)

    def drop_handover(self, *, expired_only: bool = False) -> bool:
        """Remove the hand-over from the seal file (the caller holds the rotation lock)."""
        document = self._document(self.path)
        handover = None if document is None else document.get("handover")
        if document is None or handover is None:
            return False
        expires = handover.get("expires") if isinstance(handover, dict) else None
        if expired_only and isinstance(expires, float | int) and expires >= time.time():
            return False
        del document["handover"]
        atomic_write(self.path, orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
        return True
