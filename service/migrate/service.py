"""The service side of a migration: check the keys, rewrap a page, recognise rows already
under the target key, verify a sample. Only ciphertext goes to the service and comes back,
except for ``--verify``'s sample, whose plaintexts are compared in memory and dropped.

Which key a token is under: a token carries its key's *type* id, not its name. A token of the
source key's type goes to ``rewrap`` from the source key with ``to_key``. A token of the target
key's type (or one the source key cannot decrypt when both keys have one type) is *probed*:
``rewrap`` under the target key alone answers whether the target key decrypts it, without any
plaintext leaving the service; the probe's output is discarded and the row skipped as already
migrated. A token the probe cannot open either (damaged, under a third key of that type, wrong
aad) fails with its reason, and a token of any other type fails without a request.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from cryptd_client import (
    CryptdAPIError,
    CryptdClient,
    CryptdConnectionError,
    DecryptResult,
    EncryptResult,
    KeyMetadata,
    api_error,
)

from . import tokens
from .model import (
    FAIL_OTHER_KEY,
    FAIL_VERIFY,
    SKIP_ALREADY,
    SKIP_NULL,
    Kind,
    MigrationRefused,
    Outcome,
    Page,
    RunStopped,
)
from .sampling import Sampler

# Item errors that may mean the key itself went away or changed state (not the row).
_KEY_CODES = frozenset({"key_disabled", "key_not_found"})
# Item or request errors after which nothing else can succeed.
_STOP_CODES = frozenset({"forbidden", "unauthenticated"})
_USABLE_SOURCE = frozenset({"enabled", "decrypt_only"})
_KEY_CHECK_INTERVAL = 5.0
_MAX_REQUEST_BYTES = 768 * 1024  # under the service's default 1 MiB body limit
_ITEM_OVERHEAD = 64  # field names, quotes and commas of one item
_TRANSPORT_RETRIES = 5
# A batch call of the client: (key, items) -> one result or item error per item.
_Send = Callable[[str, list[dict[str, Any]]], list[Any]]
R = TypeVar("R")
_NULL = Outcome.skipped(SKIP_NULL)
_ALREADY = Outcome.skipped(SKIP_ALREADY)


@dataclass(frozen=True, slots=True)
class KeyInfo:
    name: str
    type: str | None  # None: the client may not read the key's metadata
    type_id: int | None
    state: str | None  # None: the service shows no key states

    @property
    def label(self) -> str:
        return f"{self.name} ({self.type})" if self.type else self.name


def _type_facts(type_name: str) -> tuple[int | None, bool]:
    """(token type id, can encrypt) for a type this installation knows."""
    from service.crypto.registry import KEY_TYPES

    known = KEY_TYPES.get(type_name)
    if known is None:
        return None, True
    return known.type_id, known.supports("encrypt")


def resent(call: Callable[[], R]) -> R:
    """``call()``, sent again after a transport error (a connection reset or a read timeout
    after the request went out). For the requests of a migration that is safe: rewrap, decrypt
    and reading metadata change nothing, and nothing is written before the answer. Raises
    RunStopped when the service keeps failing."""
    for attempt in range(_TRANSPORT_RETRIES + 1):
        try:
            return call()
        except httpx.TransportError as exc:
            if attempt == _TRANSPORT_RETRIES:
                raise RunStopped(f"the service did not answer: {exc!r}") from None
            time.sleep(0.2 * 2**attempt)
    raise AssertionError("unreachable")


def _describe(client: CryptdClient, name: str, warnings: list[str]) -> KeyInfo:
    try:
        meta: KeyMetadata = resent(lambda: client.get_key(name))
    except RunStopped as exc:
        raise MigrationRefused(str(exc)) from None
    except CryptdConnectionError as exc:
        raise MigrationRefused(f"cannot reach the service: {exc}") from None
    except CryptdAPIError as exc:
        if exc.code == "key_not_found":
            raise MigrationRefused(f"the service has no key {name!r}") from None
        if exc.code == "forbidden":
            warnings.append(
                f"this client may not read the metadata of {name!r}: its type and state are "
                "not checked, and every token is sent to the service to find out"
            )
            return KeyInfo(name, None, None, None)
        raise MigrationRefused(f"reading key {name!r}: {exc}") from None
    state = meta.raw.get("state")
    type_id, _ = _type_facts(meta.type)
    return KeyInfo(name, meta.type, type_id, None if state is None else str(state))


def preflight(
    client: CryptdClient, from_key: str, to_key: str
) -> tuple[KeyInfo, KeyInfo, list[str]]:
    """Check both keys before anything is read; refuse when no row could be migrated."""
    if from_key == to_key:
        raise MigrationRefused("--from-key and --to-key are the same key")
    warnings: list[str] = []
    source = _describe(client, from_key, warnings)
    target = _describe(client, to_key, warnings)
    if target.type is not None and not _type_facts(target.type)[1]:
        raise MigrationRefused(f"the target key {target.label} cannot encrypt")
    if source.type is not None and not _type_facts(source.type)[1]:
        raise MigrationRefused(f"the source key {source.label} holds no ciphertexts")
    if target.state not in (None, "enabled"):
        raise MigrationRefused(
            f"the target key {to_key!r} is {target.state}: it takes no new encryptions, so no "
            f'row could be migrated to it (PATCH /v1/keys/{to_key} {{"state": "enabled"}})'
        )
    if source.state is not None and source.state not in _USABLE_SOURCE:
        raise MigrationRefused(
            f"the source key {from_key!r} is {source.state}: nothing can be decrypted under it"
        )
    return source, target, warnings


@dataclass(slots=True)
class BatchResult:
    outcomes: list[Outcome]
    verified: int = 0


class Rewrapper:
    """Turns a page of rows into outcomes. Called from several threads at once: the client
    (one httpx connection pool) is shared, which also keeps its set-up cost to one."""

    def __init__(self, client: CryptdClient, source: KeyInfo, target: KeyInfo) -> None:
        self._client = client
        self.source = source
        self.target = target
        self._same_type = source.type_id is None or source.type_id == target.type_id
        self._check_lock = threading.Lock()
        self._keys_checked = 0.0
        # Items per request: the service's default batch limit, lowered for good by a 413
        # (its limit is smaller) and for a while by a 503 (it cannot finish so much in time).
        self._size_limit = 1000
        self._load_limit = 1000
        self._successes = 0

    # -- one page ---------------------------------------------------------------------------

    def process(self, page: Page, sampler: Sampler | None = None) -> BatchResult:
        """The page's outcomes; with a ``sampler``, some migrated rows are verified."""
        tokens_ = page.tokens
        outcomes: list[Outcome | None] = [None] * len(tokens_)
        for index, failure in page.failures.items():
            outcomes[index] = Outcome.failed(*failure)
        rewrap: list[int] = []
        probe: list[int] = []
        source_id, target_id = self.source.type_id, self.target.type_id
        for index, token in enumerate(tokens_):
            if outcomes[index] is not None:
                continue
            if token is None:
                outcomes[index] = _NULL
                continue
            kind = tokens.type_id(token)
            if kind == source_id or source_id is None:
                rewrap.append(index)
            elif isinstance(kind, tuple):
                outcomes[index] = Outcome.failed(*kind)
            elif kind == target_id:
                probe.append(index)
            else:
                outcomes[index] = Outcome.failed(
                    FAIL_OTHER_KEY,
                    f"the token is of another key type (id {kind}), "
                    f"neither {self.source.label} nor {self.target.label}",
                )
        if rewrap:
            to_key = self.target.name
            items = [
                {"ciphertext": tokens_[i], "aad": page.aad(i), "to_key": to_key} for i in rewrap
            ]
            for index, result in self._rewrapped(self.source.name, rewrap, items, outcomes):
                if result is not None:
                    outcomes[index] = Outcome(Kind.MIGRATED, result.ciphertext)
                elif self._same_type:
                    probe.append(index)
                else:
                    outcomes[index] = Outcome.failed(
                        "decryption_failed",
                        f"does not decrypt under {self.source.name!r} "
                        "(damaged, another key of its type, or another aad)",
                    )
        if probe:
            probe.sort()
            items = [{"ciphertext": tokens_[i], "aad": page.aad(i)} for i in probe]
            for index, result in self._rewrapped(self.target.name, probe, items, outcomes):
                if result is not None:
                    outcomes[index] = _ALREADY
                else:
                    outcomes[index] = Outcome.failed(
                        "decryption_failed",
                        f"decrypts under neither {self.source.name!r} nor {self.target.name!r} "
                        "(damaged, another key, or another aad)",
                    )
        done: list[Outcome] = [o for o in outcomes if o is not None]
        assert len(done) == len(tokens_)
        verified = 0
        if sampler is not None:
            migrated = [i for i, o in enumerate(done) if o.kind is Kind.MIGRATED]
            sample = sampler.pick(migrated, len(done))
            verified = self._verify(page, done, sample) if sample else 0
        return BatchResult(done, verified)

    def _rewrapped(
        self,
        key: str,
        indexes: list[int],
        items: list[dict[str, Any]],
        outcomes: list[Outcome | None],
    ) -> Iterator[tuple[int, EncryptResult | None]]:
        """Each item rewrapped under ``key``: its result, or None where it does not decrypt
        there; any other item failure is recorded in ``outcomes`` (or stops the run)."""
        results: list[EncryptResult | CryptdAPIError] = self._send(
            self._client.rewrap_batch, key, items
        )
        for index, result in zip(indexes, results, strict=True):
            if isinstance(result, EncryptResult):
                yield index, result
            elif result.code == "decryption_failed":
                yield index, None
            else:
                outcomes[index] = self._item_failure(result)

    # -- requests the service accepts ---------------------------------------------------
    # The service refuses a body over CRYPTD_MAX_BODY_BYTES (1 MiB by default) and a batch over
    # CRYPTD_MAX_BATCH_ITEMS (1,000): a page is cut into requests under both, and a 413 halves
    # the request (and every later one), so large tokens or a smaller limit never stop a run.

    def _send(
        self,
        send: _Send,
        key: str,
        items: list[dict[str, Any]],
    ) -> list[Any]:
        results: list[Any] = []
        chunk: list[dict[str, Any]] = []
        size = 0
        for item in items:
            item_size = _request_size(item)
            if chunk and (size + item_size > _MAX_REQUEST_BYTES or len(chunk) >= self._limit()):
                results += self._send_chunk(send, key, chunk)
                chunk, size = [], 0
            chunk.append(item)
            size += item_size
        if chunk:
            results += self._send_chunk(send, key, chunk)
        return results

    def _limit(self) -> int:
        return min(self._size_limit, self._load_limit)

    def _send_chunk(
        self,
        send: _Send,
        key: str,
        chunk: list[dict[str, Any]],
    ) -> list[Any]:
        try:
            results = list(resent(lambda: send(key, chunk)))
        except CryptdConnectionError as exc:
            raise RunStopped(f"cannot reach the service: {exc}") from None
        except CryptdAPIError as exc:
            return self._refused(send, key, chunk, exc)
        with self._check_lock:  # after a 503, grow back: double every 20 requests that pass
            self._successes += 1
            if self._load_limit < self._size_limit and self._successes >= 20:
                self._load_limit = min(self._size_limit, self._load_limit * 2)
                self._successes = 0
        return results

    def _refused(
        self, send: _Send, key: str, chunk: list[dict[str, Any]], exc: CryptdAPIError
    ) -> list[Any]:
        """A request refused whole (after the client's own retries): a request too large for
        the service (413) or too much for it to finish in time (503) is halved; anything else
        stops the run."""
        if exc.code not in ("payload_too_large", "overloaded"):
            raise RunStopped(f"the service refused a request under {key!r}: {exc}") from None
        if len(chunk) == 1:
            if exc.code == "overloaded":
                raise RunStopped(f"the service stays overloaded: {exc}") from None
            message = "the row is larger than the service accepts in one request"
            return [api_error(413, "payload_too_large", message)]
        half = len(chunk) // 2
        with self._check_lock:
            if exc.code == "payload_too_large":
                self._size_limit = max(1, min(self._size_limit, half))
            self._load_limit = max(1, min(self._load_limit, half))
            self._successes = 0
        head = self._send_chunk(send, key, chunk[:half])
        return head + self._send_chunk(send, key, chunk[half:])

    def _item_failure(self, error: CryptdAPIError) -> Outcome:
        if error.code in _STOP_CODES:
            raise RunStopped(f"the service refused an item: {error}")
        if error.code in _KEY_CODES:
            self._check_keys()  # raises when the key itself is gone or unusable
        return Outcome.failed(error.code, error.message)

    def _check_keys(self) -> None:
        """After an item error that names a key: stop when a key is gone or unusable, else the
        error belongs to the row (e.g. a token version the key does not have)."""
        with self._check_lock:
            if time.monotonic() - self._keys_checked < _KEY_CHECK_INTERVAL:
                return
            try:
                preflight(self._client, self.source.name, self.target.name)
            except MigrationRefused as exc:
                raise RunStopped(str(exc)) from None
            self._keys_checked = time.monotonic()

    # -- verification -------------------------------------------------------------------

    def _verify(self, page: Page, outcomes: list[Outcome], sample: Sequence[int]) -> int:
        chosen = [i for i in sample if outcomes[i].kind is Kind.MIGRATED]
        if not chosen:
            return 0
        old = self._decrypt(self.source.name, [(page.tokens[i], page.aad(i)) for i in chosen])
        new = self._decrypt(self.target.name, [(outcomes[i].token, page.aad(i)) for i in chosen])
        for index, before, after in zip(chosen, old, new, strict=True):
            if isinstance(before, CryptdAPIError):
                message = f"could not decrypt the old token for verification: {before.code}"
                outcomes[index] = Outcome.failed(FAIL_VERIFY, message)
            elif isinstance(after, CryptdAPIError):
                message = f"could not decrypt the new token for verification: {after.code}"
                outcomes[index] = Outcome.failed(FAIL_VERIFY, message)
            elif not hmac.compare_digest(before.plaintext, after.plaintext):
                message = "the new token does not decrypt to the original plaintext"
                outcomes[index] = Outcome.failed(FAIL_VERIFY, message)
        return len(chosen)

    def _decrypt(
        self, key: str, items: list[tuple[str | None, bytes | None]]
    ) -> list[DecryptResult | CryptdAPIError]:
        body = [{"ciphertext": token, "aad": aad} for token, aad in items]
        try:
            return self._send(self._client.decrypt_batch, key, body)
        except RunStopped as exc:
            raise RunStopped(f"--verify: {exc}") from None


def _request_size(item: dict[str, Any]) -> int:
    """An upper bound of the item's bytes in a request body."""
    aad = item.get("aad")
    size = _ITEM_OVERHEAD + len(item["ciphertext"]) + len(item.get("to_key") or "")
    return size + (len(aad) * 4 // 3 + 4 if aad else 0)
