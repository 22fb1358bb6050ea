"""Retries on a real 503 with Retry-After: a cryptd over HTTPS (its development CA) whose
Redis replay store loses its epoch, as a Redis restart or flush does. The next signed request
sets a new epoch and every request signed in the following max-skew seconds is refused (503
"replay store restarted: sign the request again", Retry-After). The Python client and
`cryptd call` sign again after the wait and get through; key management that changes state
is never sent twice."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cryptd_client import (
    AsyncCryptdClient,
    CryptdClient,
    KeyNotFoundError,
    OverloadedError,
)
from service.cli import main
from tests.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # a live server on a real Redis

# A database of the shared Redis for these servers alone: the tests delete its epoch key.
REDIS_DB = 12
EPOCH_KEY = "cryptd:nonce:epoch"
# The refusal window lasts the server's max skew: 2 s keeps it short, and above the one
# second by which a whole-second `created` may trail the clock.
MAX_SKEW = 2


def replay_store_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"


def reopen_replay_window(url: str) -> None:
    """What a Redis restart or flush does to the replay store: the epoch is gone, so the
    next signed request sets a new one and opens the refusal window."""
    import redis

    with redis.Redis.from_url(url) as client:
        client.delete(EPOCH_KEY)


def start_recovering_server(directory: Path, redis_url: str) -> tuple[Server, str]:
    """``cryptd serve --dev --tls`` on its own Redis database; returns it and that URL."""
    url = replay_store_url(redis_url)
    reopen_replay_window(url)
    env = {"CRYPTD_REDIS_URL": url, "CRYPTD_SIGNATURE_MAX_SKEW": str(MAX_SKEW)}
    return start_server(directory, env, tls=True), url


@pytest.fixture(scope="module")
def recovering(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[tuple[Server, str]]:
    server, url = start_recovering_server(tmp_path_factory.mktemp("retry"), redis_url)
    yield server, url
    stop_server(server)
    reopen_replay_window(url)


def _credential(server: Server) -> Path:
    path = Path(server.directory) / "dev" / "client.json"
    assert json.loads(path.read_text())["url"].startswith("https://")
    return path


def _open_window(server: Server, url: str) -> None:
    """Reopen the window and prove it open: a client that never retries is refused."""
    reopen_replay_window(url)
    once = CryptdClient.from_file(_credential(server), retries=0)
    with once, pytest.raises(OverloadedError) as info:
        once.random(8)
    assert info.value.status == 503
    assert "sign the request again" in info.value.message


def test_client_signs_again_after_retry_after(recovering: tuple[Server, str]) -> None:
    server, url = recovering
    _open_window(server, url)
    started = time.monotonic()
    with CryptdClient.from_file(_credential(server)) as client:
        token = client.encrypt("aes256-gcm", b"after the window").ciphertext
        assert client.decrypt("aes256-gcm", token).plaintext == b"after the window"
    # The refusal named a wait of about the max skew, and the client honoured it.
    assert time.monotonic() - started >= 0.9


async def test_async_client_signs_again(recovering: tuple[Server, str]) -> None:
    server, url = recovering
    _open_window(server, url)
    async with AsyncCryptdClient.from_file(_credential(server)) as client:
        assert len(await client.random(16)) == 16


def test_key_management_is_never_retried(recovering: tuple[Server, str]) -> None:
    server, url = recovering
    _open_window(server, url)
    with CryptdClient.from_file(_credential(server)) as admin:
        before = admin.get_key("aes256-gcm").latest_version  # a read: retried through
        _open_window(server, url)
        started = time.monotonic()
        with pytest.raises(OverloadedError):
            admin.create_key("retry-created", "aes256-gcm")
        with pytest.raises(OverloadedError):
            admin.rotate_key("aes256-gcm")
        with pytest.raises(OverloadedError):
            admin.update_key("aes256-gcm", state="decrypt_only")
        # Refused at once: no wait, no second copy.
        assert time.monotonic() - started < 0.9
        # After the window (reads retry through it), nothing changed.
        with pytest.raises(KeyNotFoundError):
            admin.get_key("retry-created")
        after = admin.get_key("aes256-gcm")
        assert (after.latest_version, after.raw["state"]) == (before, "enabled")


def _call(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    status = main(["call", *args])
    out = capsys.readouterr()
    return status, json.loads(out.out) if out.out.strip() else None, out.err


def test_cryptd_call_retries_crypto_not_key_management(
    recovering: tuple[Server, str], capsys: pytest.CaptureFixture[str]
) -> None:
    server, url = recovering
    credential = ["--credential", str(_credential(server))]
    _open_window(server, url)
    status, result, _ = _call(["encrypt", "aes256-gcm", "--data", "hi", *credential], capsys)
    assert status == 0
    assert result["ciphertext"].startswith("cryptd:v")

    _open_window(server, url)
    status, _, err = _call(["create", "call-created", "--type", "aes256-gcm", *credential], capsys)
    assert status == 1
    assert json.loads(err)["error"]["status"] == 503
    status, _, err = _call(["key", "call-created", *credential], capsys)
    assert status == 1
    assert json.loads(err)["error"]["code"] == "key_not_found"
