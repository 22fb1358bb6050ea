"""CryptdClient / AsyncCryptdClient end to end through the real middleware and a real server,
and the `cryptd call` command."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cryptd_client import (
    AsyncCryptdClient,
    ConflictError,
    CryptdAPIError,
    CryptdClient,
    CryptdConnectionError,
    DecryptionFailedError,
    ForbiddenError,
    KeyNotFoundError,
    OverloadedError,
    RateLimitedError,
    UnauthenticatedError,
    api_error,
)
from service.cli import main
from tests.test_auth_support import FakeService, Server, free_port, make_app, standard_clients

pytestmark = pytest.mark.slow  # a live server and the cryptd command


class Env:
    def __init__(self, url: str, secrets: dict[str, str], service: FakeService, tmp: Path) -> None:
        self.url, self.secrets, self.service, self.tmp = url, secrets, service, tmp

    def client(self, name: str = "app", **options: Any) -> CryptdClient:
        return CryptdClient(self.url, name, self.secrets[name], **options)

    def async_client(self, name: str = "app", **options: Any) -> AsyncCryptdClient:
        return AsyncCryptdClient(self.url, name, self.secrets[name], **options)

    def credential(self, name: str = "app") -> Path:
        path = self.tmp / f"{name}.json"
        path.write_text(
            json.dumps({"url": self.url, "client_id": name, "secret": self.secrets[name]})
        )
        return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("client")
    secrets = standard_clients(tmp / "clients.json")
    service = FakeService()
    with Server(make_app(tmp / "clients.json", service=service)) as srv:
        environment = Env(srv.url, secrets, service, tmp)
        with environment.client("admin") as admin:
            for name in ("orders", "billing", "signing"):
                admin.create_key(name, "aes256-gcm", deletion_allowed=name == "billing")
        yield environment


def test_encrypt_decrypt_round_trip(env: Env) -> None:
    with CryptdClient.from_file(env.credential()) as client:
        encrypted = client.encrypt("orders", b"\x00secret\xff", aad=b"ctx")
        assert encrypted.ciphertext.startswith("cryptd:v1:")
        assert encrypted.key_version == 1
        decrypted = client.decrypt("orders", encrypted.ciphertext, aad=b"ctx")
        assert decrypted.plaintext == b"\x00secret\xff"
        assert "secret" not in repr(decrypted)
        with pytest.raises(DecryptionFailedError) as info:
            client.decrypt("orders", encrypted.ciphertext, aad=b"other")
        assert info.value.status == 400
        assert info.value.code == "decryption_failed"
        assert info.value.request_id is not None
        assert len(info.value.request_id) == 32
        with pytest.raises(KeyNotFoundError):
            client.encrypt("missing", b"x")


def test_sign_verify_rewrap_datakey(env: Env) -> None:
    with env.client() as client:
        signed = client.sign("signing", b"message")
        assert len(signed.signature) == 32
        assert client.verify("signing", b"message", signature=signed.signature)
        assert not client.verify("signing", b"other", signature=signed.signature)
        assert client.sign("signing", digest=b"\x01" * 32).key_version == 1
        with pytest.raises(ValueError, match="exactly one"):
            client.sign("signing", b"m", digest=b"d")
        with pytest.raises(ValueError, match="exactly one"):
            client.verify("signing", signature=b"s")

        token = client.encrypt("orders", b"move me").ciphertext
        moved = client.rewrap("orders", token, to_key="billing")
        assert client.decrypt("billing", moved.ciphertext).plaintext == b"move me"

        data_key = client.datakey("orders", bits=128)
        assert len(data_key.plaintext) == 16
        assert client.decrypt("orders", data_key.ciphertext).plaintext == data_key.plaintext
        assert "plaintext" not in repr(data_key)


def test_key_management(env: Env) -> None:
    with env.client("admin") as admin, env.client() as app:
        created = admin.create_key("temp", "ed25519", deletion_allowed=False)
        assert (created.name, created.type, created.latest_version) == ("temp", "ed25519", 1)
        assert created.deletion_allowed is False
        with pytest.raises(ConflictError):
            admin.create_key("temp", "ed25519")
        assert admin.rotate_key("temp").latest_version == 2
        meta = app.get_key("temp")
        assert [v.version for v in meta.versions] == [1, 2]
        assert meta.versions[0].created_at == "2024-01-01T00:00:00Z"
        assert "temp" in [k.name for k in app.list_keys()]
        with pytest.raises(ConflictError):
            admin.delete_key("temp")  # deletion not allowed yet
        updated = admin.update_key("temp", min_decryption_version=2, deletion_allowed=True)
        assert (updated.min_decryption_version, updated.deletion_allowed) == (2, True)
        with pytest.raises(ValueError, match="give"):
            admin.update_key("temp")
        admin.delete_key("temp")
        with pytest.raises(KeyNotFoundError) as info:
            app.get_key("temp")
        assert info.value.status == 404
        with pytest.raises(ForbiddenError) as forbidden:
            app.create_key("nope", "aes256-gcm")
        assert forbidden.value.status == 403


def test_batches_keep_order_and_per_item_errors(env: Env) -> None:
    with env.client(batch_size=2) as client:
        encrypted = client.encrypt_batch(
            "orders", [b"a", {"plaintext": b"b", "aad": b"x"}, b"c", b"d", b"e"]
        )
        assert all(not isinstance(r, CryptdAPIError) for r in encrypted)
        tokens = [r.ciphertext for r in encrypted if not isinstance(r, CryptdAPIError)]
        items: list[Any] = [tokens[0], {"ciphertext": tokens[1], "aad": b"x"}, "garbage", tokens[4]]
        decrypted = client.decrypt_batch("orders", items)
        assert [getattr(r, "plaintext", None) for r in decrypted] == [b"a", b"b", None, b"e"]
        assert isinstance(decrypted[2], DecryptionFailedError)
        assert decrypted[2].status == 400

        signatures = client.sign_batch("signing", [b"m1", b"m2"])
        sigs = [s.signature for s in signatures if not isinstance(s, CryptdAPIError)]
        checks = client.verify_batch(
            "signing",
            [(b"m1", sigs[0]), (b"m2", sigs[0]), {"message": b"m2", "signature": sigs[1]}],
        )
        assert checks == [True, False, True]
        rewrapped = client.rewrap_batch("orders", [tokens[2], {"ciphertext": tokens[3]}])
        assert all(r.key_version == 1 for r in rewrapped if not isinstance(r, CryptdAPIError))


def test_unknown_client_and_wrong_secret_are_unauthenticated(env: Env) -> None:
    wrong = CryptdClient(env.url, "app", env.secrets["admin"])
    with wrong, pytest.raises(UnauthenticatedError) as info:
        wrong.list_keys()
    assert info.value.status == 401
    assert "secret" not in repr(wrong)
    assert env.secrets["admin"] not in repr(wrong)


def test_retry_honours_retry_after(env: Env) -> None:
    with env.client() as client:
        result = client.encrypt("retry-429-2-1", b"x")
        assert result.ciphertext == "cryptd:v1:AA"
    arrivals = env.service.arrivals["retry-429-2-1"]
    assert len(arrivals) == 3
    # Each retry waited at least the second the server asked for (a lower bound only).
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(arrivals))

    with env.client() as client:
        assert client.encrypt("retry-503-1-1", b"x").key_version == 1
    assert len(env.service.arrivals["retry-503-1-1"]) == 2


def test_retry_gives_up(env: Env) -> None:
    with env.client(retries=1) as client, pytest.raises(RateLimitedError) as info:
        client.encrypt("retry-429-5-1", b"x")
    assert info.value.status == 429
    assert len(env.service.arrivals["retry-429-5-1"]) == 2
    # A Retry-After beyond the total wait budget is not slept through: fail at once.
    with env.client() as client, pytest.raises(OverloadedError):
        client.encrypt("retry-503-5-3600", b"x")
    assert len(env.service.arrivals["retry-503-5-3600"]) == 1


def test_unreachable_service() -> None:
    client = CryptdClient(f"http://127.0.0.1:{free_port()}", "app", "AAAA", retries=2)
    with client, pytest.raises(CryptdConnectionError):
        client.list_keys()


def test_healthz_and_error_mapping(env: Env) -> None:
    with env.client() as client:
        assert client.healthz() == {"status": "ok"}
    assert isinstance(api_error(None, "forbidden", "no"), ForbiddenError)
    assert api_error(None, "forbidden", "no").status == 403
    unknown = api_error(418, "teapot", "short and stout")
    assert type(unknown) is CryptdAPIError
    assert unknown.status == 418


async def test_async_client(env: Env) -> None:
    async with env.async_client() as client:
        results = await asyncio.gather(*(client.encrypt("orders", bytes([i])) for i in range(20)))
        plaintexts = await asyncio.gather(
            *(client.decrypt("orders", r.ciphertext) for r in results)
        )
        assert [p.plaintext for p in plaintexts] == [bytes([i]) for i in range(20)]
        signed = await client.sign("signing", b"m")
        assert await client.verify("signing", b"m", signature=signed.signature)
        assert len((await client.datakey("orders")).plaintext) == 32
        assert "orders" in [k.name for k in await client.list_keys()]
        batch = await client.encrypt_batch("orders", [b"1", b"2"])
        assert len(batch) == 2
        with pytest.raises(KeyNotFoundError):
            await client.get_key("missing")
        assert (await client.encrypt("retry-429-1-1", b"x")).key_version == 1


# --------------------------------------------------------------------------------------------
# `cryptd call`


def _call(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    status = main(["call", *args])
    out = capsys.readouterr()
    return status, json.loads(out.out) if out.out.strip() else None, out.err


def test_cli_call(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cred = ["--credential", str(env.credential())]
    status, enc, _ = _call(["encrypt", "orders", "--data", "hello", "--aad", "ctx", *cred], capsys)
    assert status == 0
    assert enc["key_version"] == 1

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(enc["ciphertext"].encode())))
    status, dec, _ = _call(["decrypt", "orders", "--aad", "ctx", *cred], capsys)
    assert status == 0
    assert dec["plaintext"] == "aGVsbG8="  # base64 of "hello"

    status, signed, _ = _call(["sign", "signing", "--data", "m", *cred], capsys)
    assert status == 0
    args = ["verify", "signing", "--data", "m", "--signature", signed["signature"], *cred]
    assert _call(args, capsys)[:2] == (0, {"valid": True})
    args = ["verify", "signing", "--data", "x", "--signature", signed["signature"], *cred]
    assert _call(args, capsys)[:2] == (1, {"valid": False})

    status, keys, _ = _call(["keys", *cred], capsys)
    assert status == 0
    assert "orders" in [k["name"] for k in keys["keys"]]
    status, _, err = _call(["create", "x", "--type", "aes256-gcm", *cred], capsys)
    assert status == 1
    assert json.loads(err)["error"]["code"] == "forbidden"
    admin = ["--credential", str(env.credential("admin"))]
    status, created, _ = _call(["create", "cli-key", "--type", "aes256-gcm", *admin], capsys)
    assert (status, created["name"]) == (0, "cli-key")
    assert _call(["rotate", "cli-key", *admin], capsys)[1]["latest_version"] == 2
    assert _call(["key", "cli-key", *cred], capsys)[1]["latest_version"] == 2
    assert _call(["datakey", "orders", "--bits", "128", *cred], capsys)[0] == 0

    monkeypatch.setenv("CRYPTD_DEV_DIR", str(env.tmp / "nowhere"))
    assert main(["call", "keys"]) == 2  # no credential file
    assert main(["call", "encrypt", *cred]) == 2  # no key
