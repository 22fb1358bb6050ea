"""The wrk scripts' LuaJIT SHA-256, HMAC-SHA256, base64 and RFC 9421 signer against Python's
hashlib / hmac / base64 and service.auth.signature, byte for byte; then real wrk runs against a
development server (zero non-2xx answers, and 401s with a wrong secret).

The Lua runs under a ``luajit`` binary and under wrk's own embedded LuaJIT, whichever exist
(``apt-get install -y wrk luajit``); without either the tests skip, except under CI=true.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson
import pytest

from loadtest.measure import parse_wrk_output
from loadtest.scenarios import BY_NAME, PQ_SCENARIOS, SCENARIOS, payload
from service.auth.signature import content_digest, sign_request, verify_request
from tests.conftest import Server

WRK_DIR = Path(__file__).resolve().parent.parent / "loadtest" / "wrk"
SELFTEST = WRK_DIR / "selftest.lua"
INSTALL = "apt-get install -y wrk luajit"

# RFC 4231 HMAC-SHA256 test cases 1, 2, 3, 4, 6, 7: (key, data, mac).
RFC4231 = [
    (b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (
        b"Jefe",
        b"what do ya want for nothing?",
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
    ),
    (
        b"\xaa" * 20,
        b"\xdd" * 50,
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
    ),
    (
        bytes(range(1, 26)),
        b"\xcd" * 50,
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
    ),
    (
        b"\xaa" * 131,
        b"Test Using Larger Than Block-Size Key - Hash Key First",
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
    ),
    (
        b"\xaa" * 131,
        b"This is a test using a larger than block-size key and a larger than block-size data."
        b" The key needs to be hashed before being used by the HMAC algorithm.",
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
    ),
]
# FIPS 180-4 examples.
SHA256_KNOWN = [
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (
        b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ),
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
]


def _missing(what: str) -> None:
    reason = f"{what} is not installed ({INSTALL})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}: required under CI")
    pytest.skip(reason)


LuaRunner = Callable[[Path], str]


def _luajit(cases: Path) -> str:
    binary = shutil.which("luajit")
    if binary is None:
        _missing("luajit")
        raise AssertionError("unreachable")
    return subprocess.run(
        [binary, str(SELFTEST), str(cases)], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def _wrk(cases: Path) -> str:
    binary = shutil.which("wrk")
    if binary is None:
        _missing("wrk")
        raise AssertionError("unreachable")
    # wrk runs the script's top level before it connects: the harness answers and exits.
    return subprocess.run(
        [binary, "-t1", "-c1", "-d1s", "-s", str(SELFTEST), "http://127.0.0.1:1/"],
        env={**os.environ, "LT_CASES": str(cases)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout


@pytest.fixture(params=[_luajit, _wrk], ids=["luajit", "wrk"])
def lua(request: pytest.FixtureRequest) -> LuaRunner:
    runner: LuaRunner = request.param
    return runner


def run_cases(
    lua: LuaRunner, tmp_path: Path, cases: Sequence[tuple[str, Sequence[bytes]]]
) -> list[list[bytes]]:
    """Answers of the Lua harness, one list of byte fields per case."""
    path = tmp_path / "cases.txt"
    path.write_text(
        "\n".join("\t".join([op.encode().hex(), *(a.hex() for a in args)]) for op, args in cases)
        + "\n"
    )
    output = lua(path)
    header, *lines = output.rstrip("\n").split("\n")
    assert header.startswith("SELFTEST LuaJIT"), header  # LuaJIT, not a plain Lua
    assert len(lines) == len(cases)
    return [[bytes.fromhex(field) for field in line.split("\t")] for line in lines]


def _rng() -> random.Random:
    return random.Random(9421)  # fixed seed: the same cases every run


# Lengths around the 55/56/64-byte padding boundaries, and multi-block messages.
LENGTHS = [0, 1, 2, 3, 31, 32, 54, 55, 56, 57, 63, 64, 65, 111, 119, 120, 127, 128, 129, 1000]


def test_sha256_known_answers_and_hashlib(lua: LuaRunner, tmp_path: Path) -> None:
    rng = _rng()
    messages = [m for m, _ in SHA256_KNOWN]
    messages += [rng.randbytes(n) for n in LENGTHS]
    messages += [bytes(range(256)) * 4, rng.randbytes(200_000)]
    answers = run_cases(lua, tmp_path, [("sha256", [m]) for m in messages])
    for (message, expected), (answer,) in zip(SHA256_KNOWN, answers, strict=False):
        assert answer.hex() == expected, message
    for message, (answer,) in zip(messages, answers, strict=True):
        assert answer == hashlib.sha256(message).digest(), len(message)


def test_hmac_sha256_rfc4231_and_hmac_module(lua: LuaRunner, tmp_path: Path) -> None:
    rng = _rng()
    pairs = [(key, data) for key, data, _ in RFC4231]
    pairs += [
        (rng.randbytes(k), rng.randbytes(m))
        for k in (0, 1, 32, 63, 64, 65, 200)
        for m in (0, 55, 64, 300)
    ]
    answers = run_cases(lua, tmp_path, [("hmac", [key, data]) for key, data in pairs])
    for (_key, _data, expected), (answer,) in zip(RFC4231, answers, strict=False):
        assert answer.hex() == expected
    for (key, data), (answer,) in zip(pairs, answers, strict=True):
        assert answer == hmac.digest(key, data, "sha256"), (len(key), len(data))


def test_base64_both_ways(lua: LuaRunner, tmp_path: Path) -> None:
    rng = _rng()
    blobs = [rng.randbytes(n) for n in range(12)] + [bytes(range(256)), rng.randbytes(1000)]
    cases = [("b64", [b]) for b in blobs] + [("unb64", [base64.b64encode(b)]) for b in blobs]
    answers = run_cases(lua, tmp_path, cases)
    for blob, (answer,) in zip(blobs, answers[: len(blobs)], strict=True):
        assert answer == base64.b64encode(blob)
    for blob, (answer,) in zip(blobs, answers[len(blobs) :], strict=True):
        assert answer == blob


def test_content_digest_and_payload_match_python(lua: LuaRunner, tmp_path: Path) -> None:
    bodies = [b"", b"{}", orjson.dumps(BY_NAME["aes-batch"].cryptd.body(None))]
    cases = [("digest", [b]) for b in bodies] + [("payload", [b"1024"]), ("payload", [b"32"])]
    answers = run_cases(lua, tmp_path, cases)
    for body, (answer,) in zip(bodies, answers, strict=False):
        assert answer.decode() == content_digest(body)
    # The wrk scripts' built-in bodies use the same filler as loadtest/scenarios.py.
    assert answers[-2] == [payload(1024)]
    assert answers[-1] == [payload(32)]


SIGN_CASES = [
    # method, path, query, body, client id, secret, created, nonce
    (
        "POST",
        "/v1/encrypt/aes256-gcm",
        "",
        orjson.dumps(BY_NAME["aes-encrypt"].cryptd.body(None)),
        "dev",
        bytes(range(32)),
        1_700_000_000,
        "AbCd0123-1-42",
    ),
    ("post", "/v1/sign/rsa-2048", "", b'{"message":"aGk="}', "svc.a", b"\xff" * 64, 1, "n"),
    ("GET", "/v1/keys", "", b"", "admin_1", b"k" * 100, 2_000_000_000, "x" * 128),
    ("GET", "", "a=1&b=%20", b"", "c", b"\x00" * 32, 123, "!#$%&'()*+,-./:;<=>?@[]^_`{|}~"),
    (
        "POST",
        "/v1/encrypt/aes256-gcm",
        "",
        orjson.dumps(BY_NAME["aes-batch"].cryptd.body(None)),
        "dev",
        os.urandom(32),
        1_800_000_000,
        "batch",
    ),
]


def test_sign_equals_python_signer(lua: LuaRunner, tmp_path: Path) -> None:
    cases = [
        (
            "sign",
            [
                m.encode(),
                p.encode(),
                q.encode(),
                body,
                cid.encode(),
                secret,
                str(c).encode(),
                n.encode(),
            ],
        )
        for m, p, q, body, cid, secret, c, n in SIGN_CASES
    ]
    answers = run_cases(lua, tmp_path, cases)
    for (method, path, query, body, cid, secret, created, nonce), answer in zip(
        SIGN_CASES, answers, strict=True
    ):
        expected = sign_request(method, path, query, body, cid, secret, created, nonce)
        got = dict(
            zip(
                ("Content-Type", "Content-Digest", "Signature-Input", "Signature"),
                (field.decode("ascii") for field in answer),
                strict=True,
            )
        )
        assert got == expected

        # And the service's verifier accepts what the Lua signed.
        def secret_for(keyid: str, cid: str = cid, secret: bytes = secret) -> bytes | None:
            return secret if keyid == cid else None

        verify_request(
            method=method.upper(),
            path=path,
            query=query,
            headers={k.lower(): v for k, v in got.items()},
            body=body,
            secret_for=secret_for,
            now=created,
        )


# --------------------------------------------------------------------------------------------
# Real wrk runs against a development server


def _wrk_binary() -> str:
    binary = shutil.which("wrk")
    if binary is None:
        _missing("wrk")
        raise AssertionError("unreachable")
    return binary


def _run_wrk(
    server: Server,
    scenario: str,
    body_file: Path | None,
    env: dict[str, str],
    seconds: int = 1,
    path: str | None = None,
) -> dict[str, object]:
    command = [
        _wrk_binary(),
        "-t1",
        "-c2",
        f"-d{seconds}s",
        "-s",
        str(WRK_DIR / "cryptd.lua"),
        server.url,
        "--",
        scenario,
    ]
    if body_file is not None:
        command.append(str(body_file))
    if path is not None:  # a scenario the script does not list: the runner's way
        command.append(path)
    done = subprocess.run(
        command,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return parse_wrk_output(done.stdout)


def _body_file(server: Server, scenario: str, tmp_path: Path, always: bool = False) -> Path | None:
    endpoint = BY_NAME[scenario].cryptd
    if endpoint.encrypt_path is None and not always:
        return None
    made = None
    if endpoint.encrypt_path is not None:
        response = server.request("POST", endpoint.encrypt_path, endpoint.encrypt_body)
        assert response.status_code == 200, response.text
        made = endpoint.made_in(response.json())
    path = tmp_path / f"{scenario}.json"
    path.write_bytes(orjson.dumps(endpoint.body(made)))
    return path


@pytest.mark.slow
def test_wrk_signed_requests_all_succeed(server: Server, tmp_path: Path) -> None:
    env = {"CRYPTD_CREDENTIALS": str(server.directory / "dev" / "client.json")}
    result = _run_wrk(server, "aes-encrypt", None, env, seconds=2)
    errors = result["errors"]
    assert isinstance(errors, dict)
    # Hundreds of requests, each with its own nonce: a reused nonce would be a 401.
    assert result["requests"] >= 200, result  # type: ignore[operator]
    assert all(count == 0 for count in errors.values()), result


# The post-quantum scenarios are not listed in cryptd.lua: the runner hands wrk their body and
# path. One key type per request shape; the others differ only in the key's name.
PQ_SHAPES = (
    "ml-dsa-65-sign",
    "ml-dsa-65-verify",
    *(f"x25519-ml-kem-768-{op}" for op in ("encrypt", "decrypt", "encapsulate", "decapsulate")),
)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", PQ_SHAPES)
def test_wrk_post_quantum_scenarios_succeed(server: Server, tmp_path: Path, scenario: str) -> None:
    env = {"CRYPTD_CREDENTIALS": str(server.directory / "dev" / "client.json")}
    body = _body_file(server, scenario, tmp_path, always=True)
    assert body is not None
    if scenario.endswith("-verify"):  # a refused signature would be a 200 too
        answer = server.request(
            "POST", BY_NAME[scenario].cryptd.path, orjson.loads(body.read_bytes())
        )
        assert answer.json()["valid"] is True
    result = _run_wrk(server, scenario, body, env, path=BY_NAME[scenario].cryptd.path)
    errors = result["errors"]
    assert isinstance(errors, dict)
    assert result["requests"] > 0, result  # type: ignore[operator]
    assert all(count == 0 for count in errors.values()), result


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario", [s.name for s in SCENARIOS if s.name != "aes-encrypt" and s not in PQ_SCENARIOS]
)
def test_wrk_every_scenario_succeeds(server: Server, tmp_path: Path, scenario: str) -> None:
    env = {"CRYPTD_CREDENTIALS": str(server.directory / "dev" / "client.json")}
    result = _run_wrk(server, scenario, _body_file(server, scenario, tmp_path), env)
    errors = result["errors"]
    assert isinstance(errors, dict)
    assert result["requests"] > 0, result  # type: ignore[operator]
    assert all(count == 0 for count in errors.values()), result


@pytest.mark.slow
def test_wrk_wrong_secret_is_refused(server: Server) -> None:
    # The zero-error runs above mean something only if the server checks: a wrong secret
    # makes every request a 401, which wrk counts as a status error.
    env = {
        "CRYPTD_CLIENT_ID": server.client_id,
        "CRYPTD_CLIENT_SECRET": base64.b64encode(b"\x01" * 32).decode(),
    }
    result = _run_wrk(server, "rsa-sign", None, env)
    errors = result["errors"]
    assert isinstance(errors, dict)
    assert result["requests"] > 0, result  # type: ignore[operator]
    assert errors["status"] == result["requests"], result
