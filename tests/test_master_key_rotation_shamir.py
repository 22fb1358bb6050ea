"""Master-key rotation under the Shamir seal: a new split with the same N and K printed once,
every version rewrapped, processes still holding the old key moving to the new one through
the hand-over, the old shares refused afterwards (with the reason), backups made before
still restoring, and a SIGKILL before or after the store commit leaving a store that opens."""

from __future__ import annotations

import base64
import io
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest

from service import operations
from service.cli import main
from service.config import SealSettings
from service.errors import CryptdError
from service.keys.admin import initialise
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.store import KeyStore
from service.seal import SealError
from service.seal import shamir_rotation as rotation_files
from service.seal.rotation import files_for, files_from_spec, files_spec, rotate, settle_store
from service.seal.shamir import ShamirSeal, ShareRefused, split
from service.seal.shamir_rotation import ShamirKeyFiles
from service.stores import open_store

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("aes256-gcm", "ed25519", "sm4-gcm")
SHARES, THRESHOLD = 3, 2
HANDOVER = ("--handover-seconds", "8")  # the workers' store check comes every few seconds


@dataclass
class Deployment:
    path: Path  # the seal file
    keyring: Path
    keystore_url: str | None
    shares: list[str]
    ciphertexts: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    opened: list[KeyStore] = field(default_factory=list)

    @property
    def settings(self) -> SealSettings:
        return SealSettings(
            seal="shamir", keyring_file=self.keyring, sealed_master_key_file=self.path
        )

    def store(self) -> KeyStore:
        store = open_store(self.keystore_url, self.keyring)
        self.opened.append(store)
        return store

    def unseal(self, shares: list[str]) -> bytes:
        seal = ShamirSeal(self.path)
        for share in shares[:THRESHOLD]:
            seal.submit(share)
        return seal.unseal()

    def open(self, shares: list[str]) -> KeyManager:
        """What a (re)starting worker does: unseal with ``shares``, settle, load."""
        seal = ShamirSeal(self.path)
        for share in shares[:THRESHOLD]:
            seal.submit(share)
        master = seal.unseal()
        store = self.store()
        settle_store(self.settings, store, seal)
        manager = KeyManager(store, MasterKey(master), lookup=ShamirKeyFiles(self.path, master))
        manager.load()
        return manager

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
        env.update(
            CRYPTD_SEAL="shamir",
            CRYPTD_SEALED_MASTER_KEY_FILE=str(self.path),
            CRYPTD_KEYRING_FILE=str(self.keyring),
            PYTHONPATH=str(ROOT),
        )
        if self.keystore_url:
            env["CRYPTD_KEYSTORE_URL"] = self.keystore_url
        return env


def _encrypt(manager: KeyManager, name: str, version: int) -> str:
    [result] = operations.run_batch(
        manager.keyring,
        "encrypt",
        name,
        [operations.EncryptItem(b"secret %d" % version, key_version=version)],
    )
    assert not isinstance(result, CryptdError)
    return str(result["ciphertext"])


def check_readable(manager: KeyManager, deployment: Deployment) -> None:
    for name, items in deployment.ciphertexts.items():
        for version, ciphertext in items:
            [result] = operations.run_batch(
                manager.keyring, "decrypt", name, [operations.DecryptItem(ciphertext)]
            )
            assert not isinstance(result, CryptdError), result
            assert base64.b64decode(result["plaintext"]) == b"secret %d" % version
    for name in TYPES:
        assert manager.keyring.key(name).latest_version == 3


@pytest.fixture
def deployments() -> Iterator[list[Deployment]]:
    made: list[Deployment] = []
    yield made
    for deployment in made:
        for store in deployment.opened:
            store.close()


def make(tmp_path: Path, made: list[Deployment], keystore_url: str | None = None) -> Deployment:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "sealed-master-key.json"
    shares = split(path, SHARES, THRESHOLD)
    deployment = Deployment(path, tmp_path / "keyring.json", keystore_url, shares)
    made.append(deployment)
    master = deployment.unseal(shares)
    store = deployment.store()
    if keystore_url:
        from service.keys.pgstore import PostgresKeyStore

        assert isinstance(store, PostgresKeyStore)
        store.create_schema()
    initialise(store, MasterKey(master))
    manager = KeyManager(store, MasterKey(master))
    manager.load()
    for name in TYPES:
        manager.create(name, name)
        manager.rotate(name)
        manager.rotate(name)
    for name in ("aes256-gcm", "sm4-gcm"):
        deployment.ciphertexts[name] = [(v, _encrypt(manager, name, v)) for v in (1, 2, 3)]
    return deployment


def _online(deployment: Deployment) -> None:
    old = deployment.unseal(deployment.shares)
    # Another worker (and a pool process: the same lookup from the spec), started before.
    other = KeyManager(
        deployment.store(), MasterKey(old), lookup=ShamirKeyFiles(deployment.path, old)
    )
    other.load()
    backup = other.backup("aes256-gcm")
    # A pool process gets the files as a spec and opens the hand-over with its start key.
    pool = files_from_spec(files_spec(files_for(deployment.settings)), old)
    files = ShamirKeyFiles(deployment.path, old)
    printed: list[list[str]] = []
    files.on_staged = printed.append
    rotator = KeyManager(deployment.store(), MasterKey(old), lookup=files)
    rotator.load()
    report = rotate(deployment.settings, rotator.snapshot, files=files)

    [shares] = printed
    assert len(shares) == SHARES
    assert len(set(shares)) == SHARES
    assert not set(shares) & set(deployment.shares)
    assert report.previous_master_key_id == MasterKey(old).key_id != report.master_key_id
    assert report.versions == 3 * len(TYPES)
    assert report.seal == "shamir"
    assert not files.staged.exists()
    document = orjson.loads(deployment.path.read_bytes())
    assert document["key_id"] == report.master_key_id
    assert (document["shares"], document["threshold"]) == (SHARES, THRESHOLD)
    assert old not in deployment.path.read_bytes()  # only wrapped keys in the file
    raw = deployment.store().read()
    assert raw is not None
    assert raw["master_key_id"] == report.master_key_id
    check_readable(rotator, deployment)

    assert pool is not None
    assert pool.find(report.master_key_id) is not None
    # The other worker moves to the new key without shares, keeping its parsed keys.
    assert other.refresh(force=True)
    assert other.master.key_id == report.master_key_id
    check_readable(other, deployment)

    # A restart needs the new shares; the old ones are refused with the reason.
    seal = ShamirSeal(deployment.path)
    with pytest.raises(ShareRefused, match="retired"):
        seal.submit(deployment.shares[0])
    assert seal.status().progress == 0
    assert seal.status().refused == 1
    restarted = deployment.open(shares[1:])
    assert restarted.master.key_id == report.master_key_id
    check_readable(restarted, deployment)

    # A backup made before the rotation restores under the new key (the retired key, kept
    # wrapped under its successor, opens it).
    new = deployment.unseal(shares)
    assert ShamirKeyFiles(deployment.path, new).find_retired(MasterKey(old).key_id) is not None
    restored = KeyManager(
        deployment.store(), MasterKey(new), lookup=ShamirKeyFiles(deployment.path, new)
    )
    restored.load()
    with pytest.raises(CryptdError):  # the name is taken: refused, nothing changes
        restored.restore("aes256-gcm", backup)
    assert restored.snapshot.backup_key(MasterKey(old).key_id) is not None

    # A second rotation: the chain goes on (the first worker follows again).
    files2 = ShamirKeyFiles(deployment.path, new)
    again: list[list[str]] = []
    files2.on_staged = again.append
    second = rotate(deployment.settings, restarted.snapshot, files=files2)
    assert other.refresh(force=True)
    assert other.master.key_id == second.master_key_id
    seal = ShamirSeal(deployment.path)
    for stale in (deployment.shares[0], shares[0]):
        with pytest.raises(ShareRefused, match="retired"):
            seal.submit(stale)
    assert ShamirKeyFiles(deployment.path, deployment.unseal(again[0])).find_retired(
        MasterKey(old).key_id
    )


def test_rotation_file_store(tmp_path: Path, deployments: list[Deployment]) -> None:
    _online(make(tmp_path, deployments))


@pytest.mark.slow
def test_rotation_postgresql_store(
    tmp_path: Path, deployments: list[Deployment], pg_database: str
) -> None:
    _online(make(tmp_path, deployments, pg_database))


def test_an_expired_hand_over_is_ignored_then_removed(
    tmp_path: Path, deployments: list[Deployment], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = make(tmp_path, deployments)
    old = deployment.unseal(deployment.shares)
    monkeypatch.setattr(rotation_files, "HANDOVER_SECONDS", -1.0)
    files = ShamirKeyFiles(deployment.path, old)
    rotator = KeyManager(deployment.store(), MasterKey(old), lookup=files)
    rotator.load()
    report = rotate(deployment.settings, rotator.snapshot, files=files)
    late = KeyManager(
        deployment.store(), MasterKey(old), lookup=ShamirKeyFiles(deployment.path, old)
    )
    with pytest.raises(Exception, match="cannot find"):
        late.load()
    assert "handover" in orjson.loads(deployment.path.read_bytes())
    deployment.open(files.shares[:THRESHOLD])  # a start drops it
    document = orjson.loads(deployment.path.read_bytes())
    assert "handover" not in document
    assert document["key_id"] == report.master_key_id


def test_an_altered_hand_over_opens_nothing(tmp_path: Path, deployments: list[Deployment]) -> None:
    deployment = make(tmp_path, deployments)
    old = deployment.unseal(deployment.shares)
    files = ShamirKeyFiles(deployment.path, old)
    rotator = KeyManager(deployment.store(), MasterKey(old), lookup=files)
    rotator.load()
    report = rotate(deployment.settings, rotator.snapshot, files=files)
    document = orjson.loads(deployment.path.read_bytes())
    wrapped = bytearray(base64.b64decode(document["handover"]["wrapped"]))
    wrapped[-1] ^= 1
    document["handover"]["wrapped"] = base64.b64encode(bytes(wrapped)).decode()
    deployment.path.write_bytes(orjson.dumps(document))
    assert ShamirKeyFiles(deployment.path, old).find(report.master_key_id) is None
    # Nor does a key other than the previous one open the hand-over.
    assert (
        ShamirKeyFiles(deployment.path, secrets.token_bytes(32)).find(report.master_key_id) is None
    )


def test_the_command_reads_the_shares_and_prints_the_new_ones(
    tmp_path: Path,
    deployments: list[Deployment],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    deployment = make(tmp_path, deployments)
    for name, value in deployment.env().items():
        if name.startswith("CRYPTD_"):
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("CRYPTD_KEYSTORE_URL", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in deployment.shares)))
    argv = ["operator", "rotate-master-key", "--handover-seconds", "0"]
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    assert "handover" not in orjson.loads(deployment.path.read_bytes())  # removed after
    first, second = out.out.splitlines()
    shares = orjson.loads(first)["shares"]
    report = orjson.loads(second)
    assert len(shares) == SHARES
    assert report["seal"] == "shamir"
    assert "previous ones are refused" in out.err
    assert deployment.open(shares[:THRESHOLD]).master.key_id == report["master_key_id"]
    # Text output: one share per line; the previous shares on stdin are refused now.
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in deployment.shares)))
    assert main(argv) == 1
    assert "retired" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in shares)))
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == SHARES
    assert all(len(line.split()) == 33 for line in lines)
    assert deployment.open(lines[1:]).keyring.key("aes256-gcm").latest_version == 3


async def test_the_route_refuses_shamir_with_the_reason(
    tmp_path: Path, deployments: list[Deployment]
) -> None:
    """New shares are never carried in a response: the route answers 409 naming the command,
    and nothing changes."""
    import httpx

    from service.api.application import create_app
    from service.auth.clients import generate_secret, write_document
    from service.auth.signature import sign_request
    from service.config import Settings

    deployment = make(tmp_path, deployments)
    secret = generate_secret()
    write_document(
        tmp_path / "clients.json",
        {"clients": {"admin": {"secret": secret, "admin": True, "allow": []}}},
    )
    settings = Settings(
        tls="off",
        seal="shamir",
        sealed_master_key_file=deployment.path,
        keyring_file=deployment.keyring,
        clients_file=tmp_path / "clients.json",
        audit_log="off",
        docs=False,
    )
    seal = ShamirSeal(deployment.path)
    for share in deployment.shares[:THRESHOLD]:
        seal.submit(share)
    before = deployment.keyring.read_bytes()
    app = create_app(settings, seal=seal)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cryptd") as http:
            path = "/v1/sys/rotate-master-key"
            headers = sign_request("POST", path, "", b"", "admin", base64.b64decode(secret))
            answer = await http.post(path, headers=headers)
    assert answer.status_code == 409, answer.text
    assert "cryptd operator rotate-master-key" in answer.json()["error"]["message"]
    assert deployment.keyring.read_bytes() == before


def test_the_files_need_the_unsealed_key(tmp_path: Path) -> None:
    from service.seal.rotation import refuse_unless_file

    settings = SealSettings(seal="shamir", keyring_file=tmp_path / "keyring.json")
    split(settings.sealed_master_key_path(), 2, 2)
    files = refuse_unless_file(settings)
    with pytest.raises(SealError, match="not unsealed here"):
        files.current()
    with pytest.raises(SealError, match="not unsealed here"):
        files.stage(secrets.token_bytes(32))


# Kill points ------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import service.seal.shamir_rotation as files

    point = sys.argv[1]
    stage, promote = files.ShamirKeyFiles.stage, files.ShamirKeyFiles.promote

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def staged(self, key):
        stage(self, key)
        if point == "staged":
            die()

    def promoting(self):
        if point == "committed":
            die()
        promote(self)

    files.ShamirKeyFiles.stage = staged
    files.ShamirKeyFiles.promote = promoting
    from service.cli import main
    sys.exit(main(["operator", "rotate-master-key", "--json"]))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["staged", "committed"])
def test_sigkill_before_and_after_the_commit(
    tmp_path: Path, deployments: list[Deployment], point: str
) -> None:
    deployment = make(tmp_path, deployments)
    old_id = MasterKey(deployment.unseal(deployment.shares)).key_id
    result = subprocess.run(
        [sys.executable, "-c", CHILD, point],
        env=deployment.env(),
        input="".join(s + "\n" for s in deployment.shares).encode(),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    # The new shares were printed before the store was rewrapped.
    printed = orjson.loads(result.stdout.splitlines()[0])["shares"]
    # A restart with the shares that still unseal the seal file (the old ones: the seal
    # file was not replaced yet) settles the rotation and opens the store.
    manager = deployment.open(deployment.shares)
    check_readable(manager, deployment)
    assert not (deployment.path.parent / (deployment.path.name + ".next")).exists()
    current = orjson.loads(deployment.path.read_bytes())["key_id"]
    if point == "staged":
        assert current == old_id == manager.master.key_id  # rolled back
    else:
        assert current != old_id
        assert manager.master.key_id == current
        check_readable(deployment.open(printed), deployment)


# A real server -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_running_server_moves_and_a_restart_needs_the_new_shares(tmp_path: Path) -> None:
    """Two workers unsealed with the shares; the command rotates while they serve; both move
    to the new key (their log says so, and a key made after the rotation encrypts on each);
    after a restart an old share is refused with the reason and the new ones unseal."""
    from tests.conftest import connections_to_every_worker
    from tests.test_seal_server import _encrypt, _serve
    from tests.test_seal_shamir_server import _unseal
    from tests.test_seal_support import make_store

    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    env = {
        **clean,
        "CRYPTD_SEAL": "shamir",
        "CRYPTD_ENV": "production",
        "CRYPTD_TLS": "off",
        "CRYPTD_CLIENTS_FILE": str(tmp_path / "clients.json"),
        "CRYPTD_KEYRING_FILE": str(tmp_path / "keyring.json"),
        "CRYPTD_WORKERS": "2",
        "CRYPTD_SIGNATURE_MAX_SKEW": "1",
        "PYTHONPATH": str(ROOT),
    }
    master = secrets.token_bytes(32)
    secret = make_store(tmp_path, master)
    shares = split(tmp_path / "sealed-master-key.json", SHARES, THRESHOLD, master)
    credential = tmp_path / "operator.json"

    def point_at(url: str) -> None:
        document = {"url": url, "client_id": "app", "secret": base64.b64encode(secret).decode()}
        credential.write_bytes(orjson.dumps(document))

    with _serve(env, tmp_path, secret, until="/healthz") as server:
        point_at(server.url)
        for share in shares[:THRESHOLD]:
            assert _unseal(env, credential, share)[0] == 0
        with connections_to_every_worker(server, 2) as workers:
            before = {i: _encrypt(server, c).json()["ciphertext"] for i, c in workers.items()}
        rotation = subprocess.run(
            [sys.executable, "-m", "service", "operator", "rotate-master-key", "--json", *HANDOVER],
            input="".join(s + "\n" for s in shares[1:]),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rotation.returncode == 0, rotation.stderr
        printed, report = map(orjson.loads, rotation.stdout.splitlines())
        new_id = report["master_key_id"]
        assert "handover" not in orjson.loads((tmp_path / "sealed-master-key.json").read_bytes())
        moved = [line for line in server.log().splitlines() if "master key changed" in line]
        assert len({orjson.loads(line)["pid"] for line in moved}) >= 2, moved
        assert all(orjson.loads(line)["master_key_id"] == new_id for line in moved)
        made = server.request("POST", "/v1/keys/after", {"type": "aes256-gcm"})
        assert made.status_code == 201, made.text
        with connections_to_every_worker(server, 2) as workers:
            for index, connection in workers.items():
                answer = server.request(
                    "POST", "/v1/decrypt/payments", {"ciphertext": before[index]},
                    connection=connection,
                )  # fmt: skip
                assert answer.status_code == 200, answer.text
                answer = server.request(
                    "POST", "/v1/encrypt/after", {"plaintext": "aGk="}, connection=connection
                )
                assert answer.status_code == 200, answer.text
    with _serve(env, tmp_path, secret, until="/healthz", log="restart") as again:
        point_at(again.url)
        code, refused = _unseal(env, credential, shares[0])
        assert code == 1
        assert "retired" in orjson.dumps(refused).decode()
        for share in printed["shares"][:THRESHOLD]:
            assert _unseal(env, credential, share)[0] == 0
        with connections_to_every_worker(again, 2) as workers:
            for index, connection in workers.items():
                answer = again.request(
                    "POST", "/v1/decrypt/payments", {"ciphertext": before[index]},
                    connection=connection,
                )  # fmt: skip
                assert answer.status_code == 200, answer.text
