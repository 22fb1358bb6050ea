"""The Shamir seal: the master key exists only as SLIP-39 shares held by operators.

Splitting and combining are the vetted ``shamir-mnemonic`` package's (SLIP-39, Trezor's
reference implementation): each share is a 33-word mnemonic carrying the split's identifier,
its threshold and an RS1024 checksum, so a mistyped or altered share, or one of another split,
is refused on its own. Only the split's public facts are stored (the seal file: identifier,
threshold, share count and the master key's fingerprint), never a share.

A process starts sealed. Shares arrive one at a time (``submit``); a refused one is counted
and leaves the progress as it was. When ``threshold`` distinct shares are in, they are
combined and the result must carry the stored fingerprint, else the attempt is void (the
shares cannot tell which of them was wrong) and progress starts over.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import orjson
from shamir_mnemonic import MnemonicError, combine_mnemonics, generate_mnemonics
from shamir_mnemonic.share import Share

from service.fileio import atomic_write
from service.keys.masterkey import MasterKey
from service.seal.base import SealError, SealStatus

FORMAT = "cryptd-shamir-seal/1"
MAX_SHARES = 16  # SLIP-39's limit per group
MAX_SHARE_CHARS = 1024  # 33 words of at most 8 letters, with room for spacing


class ShareRefused(SealError):
    """A share that was not accepted; progress is unchanged."""

    code = "invalid_request"


@dataclass(frozen=True)
class Split:
    identifier: int
    threshold: int
    shares: int
    key_id: str
    retired: tuple[int, ...] = ()  # identifiers of splits a master-key rotation replaced


def read_split(path: Path) -> Split:
    try:
        raw = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise SealError(
            f"no Shamir seal at {path}: run `cryptd operator init --shares N --threshold K` "
            "first, or set CRYPTD_SEALED_MASTER_KEY_FILE to where it is"
        ) from None
    except (OSError, orjson.JSONDecodeError):
        raise SealError(f"{path} cannot be read as a Shamir seal ({FORMAT})") from None
    try:
        if raw["format"] != FORMAT:
            raise ValueError
        return Split(
            int(raw["identifier"]),
            int(raw["threshold"]),
            int(raw["shares"]),
            str(raw["key_id"]),
            tuple(int(entry["identifier"]) for entry in raw.get("retired", ())),
        )
    except (KeyError, TypeError, ValueError):
        raise SealError(f"{path} is not a Shamir seal ({FORMAT})") from None


def split(path: Path, shares: int, threshold: int, master: bytes | None = None) -> list[str]:
    """Split a new (or the given) master key into ``shares`` mnemonics, any ``threshold`` of
    which rebuild it; write the seal file. The shares are returned once and stored nowhere."""
    if path.exists():
        raise SealError(
            f"a sealed master key already exists at {path}: the key store was (or may have been) "
            "written under it; move it away only if you mean to start over"
        )
    if not 1 <= threshold <= shares <= MAX_SHARES:
        raise SealError(f"need 1 <= threshold <= shares <= {MAX_SHARES}")
    if threshold == 1 and shares > 1:
        raise SealError("a threshold of 1 with several shares is not a split: use threshold >= 2")
    master = secrets.token_bytes(32) if master is None else master
    mnemonics, document = new_split(shares, threshold, master)
    write_document(path, document)
    return mnemonics


def new_split(
    shares: int, threshold: int, master: bytes, avoid: frozenset[int] = frozenset()
) -> tuple[list[str], dict[str, object]]:
    """The mnemonics of a new split of ``master`` and its seal document (public facts only).
    ``avoid``: identifiers of retired splits (15 random bits: a repeat is drawn again, so an
    old share is never taken for a share of this split)."""
    while True:
        mnemonics: list[str] = list(generate_mnemonics(1, [(threshold, shares)], master)[0])
        identifier = Share.from_mnemonic(mnemonics[0]).identifier
        if identifier not in avoid:
            break
    document: dict[str, object] = {
        "format": FORMAT,
        "seal": "shamir",
        "identifier": identifier,
        "threshold": threshold,
        "shares": shares,
        "key_id": MasterKey(master).key_id,
    }
    return mnemonics, document


def write_document(path: Path, document: dict[str, object]) -> None:
    atomic_write(path, orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n", mode=0o644)


class ShamirSeal:
    kind = "shamir"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.split = read_split(path)
        self._lock = threading.Lock()
        self._shares: dict[int, str] = {}  # member index -> normalised mnemonic
        self._master: bytes | None = None
        self.refused = 0

    def submit(self, text: str) -> SealStatus:
        """Take one share. ShareRefused (progress unchanged) for a malformed, altered,
        foreign or repeated share; SealError when the threshold was reached but the shares do
        not rebuild this deployment's master key (progress starts over)."""
        with self._lock:
            if self._master is not None:
                return self._status()
            try:
                mnemonic, share = self._parse(text)
                if share.index in self._shares:
                    raise ShareRefused("this share was already submitted")
            except ShareRefused:
                self.refused += 1
                raise
            self._shares[share.index] = mnemonic
            if len(self._shares) >= self.split.threshold:
                self._combine()
            return self._status()

    def _parse(self, text: str) -> tuple[str, Share]:
        if len(text) > MAX_SHARE_CHARS:
            raise ShareRefused("not a share: too long")
        mnemonic = " ".join(text.lower().split())
        try:
            share = Share.from_mnemonic(mnemonic)
        except MnemonicError:
            # The library's text quotes the share's first words: never echoed.
            raise ShareRefused(
                "not a valid share (a word is wrong or missing, or it was altered)"
            ) from None
        if share.identifier in self.split.retired:
            raise ShareRefused(
                "this share belongs to a split a master-key rotation retired: submit the "
                "shares `cryptd operator rotate-master-key` printed"
            )
        if share.identifier != self.split.identifier:
            raise ShareRefused("this share belongs to another split, not this deployment's")
        if share.group_count != 1 or share.member_threshold != self.split.threshold:
            raise ShareRefused("this share belongs to another split, not this deployment's")
        return mnemonic, share

    def _combine(self) -> None:
        shares, self._shares = list(self._shares.values()), {}
        try:
            master = bytes(combine_mnemonics(shares))
        except MnemonicError:
            master = b""
        if len(master) != 32 or not secrets.compare_digest(
            MasterKey(master).key_id, self.split.key_id
        ):
            self.refused += 1
            raise ShareRefused(
                f"the {len(shares)} shares do not rebuild this deployment's master key (one "
                "of them is not genuine): progress starts over; submit the shares again"
            )
        self._master = master

    def unseal(self) -> bytes:
        with self._lock:
            if self._master is None:
                raise SealError(
                    f"the service is sealed: {self.split.threshold} operators must submit "
                    "their shares (cryptd operator unseal)"
                )
            return self._master

    @property
    def sealed(self) -> bool:
        return self._master is None

    def status(self) -> SealStatus:
        with self._lock:
            return self._status()

    def _status(self) -> SealStatus:
        return SealStatus(
            self.kind,
            sealed=self._master is None,
            threshold=self.split.threshold,
            progress=len(self._shares),
            available=True,
            refused=self.refused,
        )

    def close(self) -> None:
        with self._lock:
            self._shares.clear()
