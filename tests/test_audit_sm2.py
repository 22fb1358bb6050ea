"""Audit checkpoints signed with SM2: the checkpoint key's type decides, the verifier (and
``cryptd audit verify``) handles Ed25519 and SM2 alike, OpenSSL's own SM2 verifier accepts the
signatures, and every kind of tampering is caught in an SM2-checkpointed trail."""

from __future__ import annotations

import asyncio
import base64
import secrets
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.rsa import generate_private_key
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from service.audit import chain, checkpoint, redact
from service.audit.verify import verify
from service.audit.writer import AuditWriter
from service.cli import main
from service.keys.admin import create_keyring_file
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.logs.audit import Audit, RequestRecord, keyring_signer
from service.stores import open_store


@pytest.fixture
def manager(tmp_path: Path) -> KeyManager:
    master = secrets.token_bytes(32)
    (tmp_path / "master.key").write_text(base64.b64encode(master).decode())
    create_keyring_file(tmp_path / "keyring.json", MasterKey(master))
    found = KeyManager(open_store(None, tmp_path / "keyring.json"), MasterKey(master))
    found.load()
    return found


def keys_of(manager: KeyManager) -> dict[int, checkpoint.VerifyingKey]:
    key = manager.keyring.internal[checkpoint.SIGNING_KEY]
    return {
        n: checkpoint.verifier_from_pem(v.handle.public_key_pem() or "")
        for n, v in key.versions.items()
    }


def record(n: int) -> RequestRecord:
    return RequestRecord(
        1_700_000_000.0 + n, "encrypt", "ok", 200, "billing", "payments", 3, 1, f"req-{n}"
    )


async def _commit(audit: Audit, count: int) -> None:
    for first in range(0, count, 5):  # groups of five: one checkpoint after each
        assert all(await asyncio.gather(*(audit.commit(record(first + n)) for n in range(5))))


@pytest.fixture
def written(tmp_path: Path, manager: KeyManager) -> Path:
    path = tmp_path / "audit.log"
    audit = Audit(None, fail_closed=True, mac=redact.salted(b"s" * 32))
    audit.trail = AuditWriter(
        str(path),
        format=audit.fields,
        signer=keyring_signer(manager, "sm2"),
        checkpoint_every=5,
    )
    audit.enabled = audit.fail_closed = True
    asyncio.run(_commit(audit, 20))
    audit.close()
    assert manager.keyring.internal[checkpoint.SIGNING_KEY].type.name == "sm2"
    report = verify([str(path)], keys_of(manager), sealed=True)
    assert report.ok, report.error
    assert report.streams[0].checkpoints >= 4
    return path


def rewrite(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def test_openssl_verifies_an_sm2_checkpoint(written: Path, manager: KeyManager) -> None:
    """An independent verifier: OpenSSL's CLI, SM3 with the GM/T 0009 default signer ID."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command")
    found = next(
        r for r in map(orjson.loads, written.read_bytes().splitlines())
        if r["event"] == chain.CHECKPOINT
    )  # fmt: skip
    pem = manager.keyring.internal[checkpoint.SIGNING_KEY].version(1).handle.public_key_pem()
    directory = written.parent
    (directory / "pub.pem").write_text(pem or "")
    (directory / "payload").write_bytes(
        checkpoint.payload(found["stream"], found["seq"], found["prev"], found["ts"])
    )
    (directory / "sig").write_bytes(base64.b64decode(found["sig"]))
    command = [openssl, "dgst", "-sm3", "-verify", "pub.pem", "-signature", "sig"]
    command += ["-sigopt", "distid:1234567812345678", "payload"]
    result = subprocess.run(command, cwd=directory, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert b"Verified OK" in result.stdout
    (directory / "payload").write_bytes(b"x" + (directory / "payload").read_bytes())
    result = subprocess.run(command, cwd=directory, capture_output=True, timeout=30)
    assert result.returncode != 0


def test_an_edited_byte_is_named(written: Path, manager: KeyManager) -> None:
    lines = written.read_bytes().splitlines()
    index = next(i for i, line in enumerate(lines) if i > 4 and b"req-" in line)
    lines[index] = lines[index].replace(b"req-", b"reQ-", 1)
    rewrite(written, lines)
    report = verify([str(written)], keys_of(manager))
    assert f"{written}:{index + 2} (seq {index + 2})" in str(report.error)  # the next line


def test_a_deleted_line_is_named(written: Path, manager: KeyManager) -> None:
    lines = written.read_bytes().splitlines()
    del lines[4]
    rewrite(written, lines)
    report = verify([str(written)], keys_of(manager))
    assert f"{written}:5 (seq 6)" in str(report.error)


def test_two_swapped_lines_are_named(written: Path, manager: KeyManager) -> None:
    lines = written.read_bytes().splitlines()
    lines[3], lines[4] = lines[4], lines[3]
    rewrite(written, lines)
    report = verify([str(written)], keys_of(manager))
    assert f"{written}:4" in str(report.error)


def test_a_truncated_file_is_named(written: Path, manager: KeyManager) -> None:
    data = written.read_bytes()
    written.write_bytes(data[: len(data) - 7])
    report = verify([str(written)], keys_of(manager))
    assert "truncated" in str(report.error)
    # Cut at a line boundary after the last checkpoint: caught by --sealed.
    lines = data.splitlines()
    last = max(i for i, line in enumerate(lines) if b"audit.checkpoint" in line)
    rewrite(written, [*lines[:last], lines[last - 1]])
    assert not verify([str(written)], keys_of(manager)).ok


def test_a_rechained_edit_fails_at_the_sm2_checkpoint(written: Path, manager: KeyManager) -> None:
    lines = written.read_bytes().splitlines()
    found = [orjson.loads(line) for line in lines]
    found[2]["outcome"] = "forbidden"
    head = chain.Head(found[1]["seq"], chain.line_hash(lines[1]))
    for index in range(2, len(found)):  # every later prev recomputed, as a forger would
        fields = {k: v for k, v in found[index].items() if k not in ("seq", "prev")}
        line, head = chain.encode(head, fields)
        lines[index] = line.rstrip(b"\n")
    rewrite(written, lines)
    report = verify([str(written)], keys_of(manager))
    assert "checkpoint signature does not verify" in str(report.error)


def test_a_signature_altered_or_by_another_key_is_refused(
    written: Path, manager: KeyManager, tmp_path: Path
) -> None:
    lines = written.read_bytes().splitlines()
    index = next(i for i, line in enumerate(lines) if b"audit.checkpoint" in line)
    found = orjson.loads(lines[index])
    signature = bytearray(base64.b64decode(found["sig"]))
    signature[-1] ^= 1
    found["sig"] = base64.b64encode(bytes(signature)).decode()
    altered = tmp_path / "altered.log"
    rewrite(altered, [*lines[:index], orjson.dumps(found)])
    assert "does not verify" in str(verify([str(altered)], keys_of(manager)).error)
    # The same trail against another deployment's SM2 key.
    create_keyring_file(tmp_path / "other.json", manager.master)
    foreign = KeyManager(open_store(None, tmp_path / "other.json"), manager.master)
    foreign.load()
    foreign.ensure_internal_key(checkpoint.SIGNING_KEY, "sm2")
    report = verify([str(written)], keys_of(foreign))
    assert "checkpoint signature does not verify" in str(report.error)


def test_the_verifier_refuses_other_key_types() -> None:
    pem = (
        generate_private_key(65537, 2048)
        .public_key()
        .public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    with pytest.raises(ValueError, match="Ed25519 or SM2"):
        checkpoint.verifier_from_pem(pem)
    with pytest.raises(ValueError, match="Ed25519 or SM2"):
        checkpoint.verifier_from_pem("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----")


def test_the_cli_makes_and_verifies_an_sm2_trail(
    tmp_path: Path, manager: KeyManager, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--keyring", str(tmp_path / "keyring.json")]
    options += ["--master-key-file", str(tmp_path / "master.key")]
    assert main(["audit", "init", "--signing-key-type", "sm2", *options]) == 0
    assert "cryptd:audit-signing: created" in capsys.readouterr().out
    manager.refresh(force=True)
    trail = tmp_path / "cli.log"
    # The service's default type is Ed25519, but the key made earlier keeps its type.
    audit = Audit.to_file(str(trail), manager, checkpoint_every=3)
    for n in range(7):
        audit.record("key.destroy", client=None, key=f"k{n}", outcome="ok")
    audit.close()
    assert manager.keyring.internal[checkpoint.SIGNING_KEY].type.name == "sm2"
    assert main(["audit", "verify", str(trail), "--sealed", *options]) == 0
    assert "audit trail verified" in capsys.readouterr().out
    assert main(["audit", "public-key", *options]) == 0
    keys = tmp_path / "audit-keys.json"
    keys.write_text(capsys.readouterr().out)
    assert main(["audit", "verify", str(trail), "--public-key", str(keys)]) == 0
    capsys.readouterr()
    lines = trail.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"k1"', b'"k9"')
    trail.write_bytes(b"".join(lines))
    assert main(["audit", "verify", str(trail), "--public-key", str(keys)]) == 1
    assert f"FAILED: {trail}:4 (seq 4)" in capsys.readouterr().out


def test_the_setting_makes_an_sm2_key_on_first_use(tmp_path: Path, manager: KeyManager) -> None:
    audit = Audit.to_file(
        str(tmp_path / "a.log"), manager, checkpoint_every=2, signing_key_type="sm2"
    )
    audit.record("key.destroy", client=None, key="k", outcome="ok")
    audit.close()
    assert manager.keyring.internal[checkpoint.SIGNING_KEY].type.name == "sm2"
    assert verify([str(tmp_path / "a.log")], keys_of(manager), sealed=True).ok
