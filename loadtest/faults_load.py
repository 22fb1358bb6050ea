"""The fault campaign's signed load: threads of the project's Python client (``cryptd_client``)
through the load balancer, every answer recorded, every accepted request kept for replay.

What a thread sends (one client each, its own keep-alive pool, the client's own retries on
429 / 503 / connection failures, each retry signed afresh):

- crypto: encrypt, decrypt of an earlier token, sign, verify of an earlier signature, a batch
  of 8 encryptions, a batch of 8 signatures, in turn;
- key management: create a key, rotate it, set it ``decrypt_only`` and back to ``enabled``.

Every request's answer is an :class:`Outcome` (its time, operation, status, whether a 503 came
with ``Retry-After``); every request answered 2xx is an :class:`Accepted` with the exact bytes
sent, which :func:`replay` sends again, unchanged, to every host directly.

An attempt that got no answer and that the client sent again (a crypto call whose connection
broke or timed out: each copy is signed afresh) is not an answer: the call's outcome is the
later attempt's, and it carries the lost attempts (``lost``) and the call's first send time
(``first_sent``), so a call served after a lost answer is accepted with its whole latency. A
call that ends without an answer is an outcome with status 0.
"""

from __future__ import annotations

import base64
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
import orjson

from cryptd_client import CryptdClient
from cryptd_client._base import CAUGHT, Steps
from cryptd_client.errors import CryptdAPIError, CryptdConnectionError

CRYPTO_KEY = "load-aes"
SIGN_KEY = "load-ed25519"
BATCH = 8
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    at: float  # monotonic, when the answer (or the connection failure) came
    operation: str
    status: int  # 0: no answer (connection refused, reset, timed out)
    retry_after: bool
    reason: str = ""  # a refusal's error code and message, shortened
    sent: float = float("nan")  # monotonic, when the request left (nan: not known; use ``at``)
    lost: tuple[str, ...] = ()  # earlier attempts of the same call that got no answer
    first_sent: float = float("nan")  # monotonic, when the call's first attempt left

    @property
    def sent_at(self) -> float:
        return self.at if self.sent != self.sent else self.sent

    @property
    def latency(self) -> float:
        """From the call's first attempt to this answer (nan: not known)."""
        return self.at - (self.sent_at if self.first_sent != self.first_sent else self.first_sent)


@dataclass(frozen=True)
class Accepted:
    at: float
    operation: str
    method: str
    target: str  # path and query as sent
    headers: tuple[tuple[str, str], ...]
    content: bytes


def operation_of(method: str, path: str, content: bytes) -> str:
    parts = path.split("?")[0].strip("/").split("/")
    if parts[:2] == ["v1", "keys"]:
        if method == "POST" and len(parts) == 4:
            return parts[3]  # rotate
        return {"POST": "create", "PATCH": "state", "GET": "read", "DELETE": "delete"}[method]
    name = parts[1] if len(parts) > 1 else path
    return f"batch-{name}" if content.startswith(b'{"batch"') else name


@dataclass
class Recorder:
    """Everything the load's clients sent and got, shared by its threads."""

    outcomes: list[Outcome] = field(default_factory=list)
    accepted: list[Accepted] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # ciphertexts under CRYPTO_KEY
    # Key changes answered 2xx: key name -> the latest version acknowledged.
    acknowledged: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_response(
        self,
        response: httpx.Response,
        sent: float = float("nan"),
        lost: tuple[str, ...] = (),
        first_sent: float = float("nan"),
    ) -> None:
        request = response.request
        now = time.monotonic()
        target = request.url.raw_path.decode("ascii")
        content = request.content
        op = operation_of(request.method, target, content)
        retry_after = "retry-after" in response.headers
        reason = "" if response.is_success else _reason(response)
        with self.lock:
            self.outcomes.append(
                Outcome(now, op, response.status_code, retry_after, reason, sent, lost, first_sent)
            )
            if response.is_success:
                headers = tuple(
                    (k, v)
                    for k, v in request.headers.items()
                    if k.lower() not in ("host", "content-length", "connection")
                )
                self.accepted.append(Accepted(now, op, request.method, target, headers, content))

    def failed(
        self, operation: str, why: str = "", sent: float = float("nan"), lost: tuple[str, ...] = ()
    ) -> None:
        with self.lock:
            self.outcomes.append(
                Outcome(time.monotonic(), operation, 0, False, why, sent, lost, sent)
            )


def _reason(response: httpx.Response) -> str:
    """``code: message`` of an error answer (the message cut short), or its start."""
    try:
        error = orjson.loads(response.read())["error"]
        return f"{error['code']}: {str(error['message'])[:200]}"
    except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError):
        return response.text[:60] if response.is_stream_consumed else ""


class RecordingClient(CryptdClient):
    """The project's blocking client with every answer handed to a :class:`Recorder`, and
    each call's attempts that got no answer (the client's own retry decisions, unchanged)."""

    recorder: Recorder

    def _open(self) -> None:
        self._sent: dict[int, float] = {}  # id of a request in flight -> when it left
        self.first_sent = float("nan")  # the current call's first attempt
        self.lost: list[str] = []  # the current call's attempts that got no answer
        self._http = httpx.Client(
            timeout=self.timeout,
            verify=self._tls_verify,
            event_hooks={"request": [self._leaving], "response": [self._record]},
        )

    def _leaving(self, request: httpx.Request) -> None:
        self._sent[id(request)] = time.monotonic()

    def _record(self, response: httpx.Response) -> None:
        sent = self._sent.pop(id(response.request), float("nan"))
        response.read()
        self.recorder.on_response(response, sent, tuple(self.lost), self.first_sent)

    def _complete(self, steps: Steps[T]) -> T:
        """:meth:`CryptdClient._complete`, noting the call's first send and lost attempts."""
        self.first_sent, self.lost = time.monotonic(), []
        for action in steps:
            if isinstance(action, httpx.Request):
                try:
                    steps.answer(self._http.send(action))
                except CAUGHT as exc:
                    self._sent.pop(id(action), None)
                    self.lost.append(type(exc).__name__)
                    steps.answer(exc)
            else:
                time.sleep(action)
        return steps.result


def _why(exc: BaseException) -> str:
    """``CryptdConnectionError (RemoteProtocolError)``: the error and what caused it."""
    cause = exc.__cause__
    return type(exc).__name__ + ("" if cause is None else f" ({type(cause).__name__})")


def client(url: str, client_id: str, secret: bytes, recorder: Recorder) -> RecordingClient:
    made = RecordingClient(url, client_id, base64.b64encode(secret).decode(), timeout=10)
    made.recorder = recorder
    return made


class Load:
    """``threads`` crypto threads and one key-management thread, until :meth:`stop`."""

    def __init__(self, url: str, client_id: str, secret: bytes, threads: int) -> None:
        self.url, self.client_id, self.secret = url, client_id, secret
        self.recorder = Recorder()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._crypto, name=f"load-{n}", daemon=True)
            for n in range(threads)
        ] + [threading.Thread(target=self._keys, name="load-keys", daemon=True)]

    def prepare(self) -> None:
        with client(self.url, self.client_id, self.secret, Recorder()) as setup:
            for name, kind in ((CRYPTO_KEY, "aes256-gcm"), (SIGN_KEY, "ed25519")):
                try:
                    setup.create_key(name, kind)
                except CryptdAPIError as exc:
                    if exc.status != 409:
                        raise

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _crypto(self) -> None:
        recorder = self.recorder
        with client(self.url, self.client_id, self.secret, recorder) as c:
            signatures: list[tuple[bytes, bytes]] = []
            step = 0
            while not self._stop.is_set():
                op = ("encrypt", "decrypt", "sign", "verify", "batch-encrypt", "batch-sign")[
                    step % 6
                ]
                step += 1
                sent = time.monotonic()  # a request that gets no answer left after this
                try:
                    if op == "encrypt":
                        token = c.encrypt(CRYPTO_KEY, secrets.token_bytes(32)).ciphertext
                        with recorder.lock:
                            recorder.tokens.append(token)
                    elif op == "decrypt":
                        with recorder.lock:
                            last = recorder.tokens[-1] if recorder.tokens else None
                        if last is not None:
                            c.decrypt(CRYPTO_KEY, last)
                    elif op == "sign":
                        message = secrets.token_bytes(32)
                        signatures.append((message, c.sign(SIGN_KEY, message).signature))
                        del signatures[:-16]
                    elif op == "verify" and signatures:
                        message, signature = signatures[-1]
                        c.verify(SIGN_KEY, message, signature=signature)
                    elif op == "batch-encrypt":
                        items = [secrets.token_bytes(16) for _ in range(BATCH)]
                        c.encrypt_batch(CRYPTO_KEY, items)
                    elif op == "batch-sign":
                        c.sign_batch(SIGN_KEY, [secrets.token_bytes(16) for _ in range(BATCH)])
                except CryptdAPIError:
                    pass  # recorded by the hook
                except (CryptdConnectionError, httpx.HTTPError) as exc:
                    # No answer, after the client's retries (each lost attempt is in ``lost``).
                    recorder.failed(op, _why(exc), sent, tuple(c.lost))

    def _keys(self) -> None:
        recorder = self.recorder
        with client(self.url, self.client_id, self.secret, recorder) as c:
            n = 0
            while not self._stop.is_set():
                name = f"m-{secrets.token_hex(4)}-{n}"
                n += 1
                try:
                    c.create_key(name, "aes256-gcm" if n % 2 else "ed25519")
                    self._ack(name, 1)
                    meta = c.rotate_key(name)
                    self._ack(name, meta.latest_version)
                    c.update_key(name, state="decrypt_only")
                    c.update_key(name, state="enabled")
                except CryptdAPIError:
                    pass
                except (CryptdConnectionError, httpx.HTTPError) as exc:
                    # Sent and not answered: never sent again (it may have been served).
                    recorder.failed("key-management", _why(exc), c.first_sent, tuple(c.lost))
                self._stop.wait(0.05)

    def _ack(self, name: str, version: int) -> None:
        with self.recorder.lock:
            self.recorder.acknowledged[name] = max(version, self.recorder.acknowledged.get(name, 0))


@dataclass
class ReplayResult:
    sent: int = 0
    by_status: Counter[int] = field(default_factory=Counter)

    @property
    def passed(self) -> int:
        """Replays that got past the signature and replay checks (anything but 401 or 503)."""
        return sum(n for status, n in self.by_status.items() if status not in (401, 503))


def replay(
    accepted: Iterable[Accepted], host_urls: Iterable[str], threads: int = 8
) -> ReplayResult:
    """Send every accepted request again, byte for byte, to every host."""
    result = ReplayResult()
    lock = threading.Lock()
    local = threading.local()
    work = [(url, a) for url in host_urls for a in accepted]

    opened: list[httpx.Client] = []

    def send(item: tuple[str, Accepted]) -> None:
        url, a = item
        if not hasattr(local, "http"):
            local.http = httpx.Client(timeout=10)
            with lock:
                opened.append(local.http)
        try:
            status = local.http.request(
                a.method, url + a.target, headers=list(a.headers), content=a.content
            ).status_code
        except httpx.HTTPError:
            status = 0
        with lock:
            result.sent += 1
            result.by_status[status] += 1

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(send, work))
    finally:
        for http in opened:
            http.close()
    return result


@dataclass
class Integrity:
    tokens: int = 0
    tokens_failed: int = 0
    keys: int = 0
    keys_lost: list[str] = field(default_factory=list)


def check_integrity(url: str, client_id: str, secret: bytes, recorder: Recorder) -> Integrity:
    """Every token made still decrypts; every acknowledged key and rotation is still there."""
    result = Integrity()
    with client(url, client_id, secret, Recorder()) as c:
        tokens = list(recorder.tokens)
        for start in range(0, len(tokens), 200):
            chunk = tokens[start : start + 200]
            answers = c.decrypt_batch(CRYPTO_KEY, chunk)
            result.tokens += len(chunk)
            result.tokens_failed += sum(isinstance(a, CryptdAPIError) for a in answers)
        for name, version in sorted(recorder.acknowledged.items()):
            result.keys += 1
            try:
                if c.get_key(name).latest_version < version:
                    result.keys_lost.append(f"{name} (version {version})")
            except CryptdAPIError:
                result.keys_lost.append(name)
    return result
