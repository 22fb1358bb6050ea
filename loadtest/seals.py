"""One cryptd server under a chosen seal, for the benchmarks that compare seals
(loadtest/seal_parity.py): the same development state (a key of every type, an admin client),
its master key kept by ``static`` (a file), ``pkcs11`` (sealed by a SoftHSM2 token's AES key)
or ``shamir`` (split 2 of 3; the server starts sealed and is unsealed through its API).

Every variant runs ``cryptd serve`` without ``--dev`` and with the same settings but the seal's,
so a difference in throughput is the seal's alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

import orjson

from loadtest.targets import Cryptd

SEALS: Final = ("static", "pkcs11", "shamir")
SOFTHSM_MODULE: Final = Path("/usr/lib/softhsm/libsofthsm2.so")
TOKEN_LABEL: Final = "cryptd-bench"  # noqa: S105 - a label, and the token a throw-away
PIN: Final = "4711-bench"  # the throw-away SoftHSM2 token of the run

_PREPARE = (
    "import sys; from pathlib import Path; from service.cli.serve import prepare_dev_dir; "
    "prepare_dev_dir(Path(sys.argv[1]), 'http://127.0.0.1')"
)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}


def _run(command: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:5])}… failed:\n{done.stderr[-2000:]}")
    return done.stdout


def _softhsm_token(directory: Path) -> dict[str, str]:
    if shutil.which("softhsm2-util") is None or not SOFTHSM_MODULE.exists():
        raise RuntimeError("the pkcs11 variant needs SoftHSM2: apt-get install -y softhsm2")
    tokens = directory / "tokens"
    tokens.mkdir(mode=0o700, parents=True, exist_ok=True)
    conf = directory / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {tokens}\nobjectstore.backend = file\n")
    env = {**_clean_env(), "SOFTHSM2_CONF": str(conf)}
    command = ["softhsm2-util", "--init-token", "--free", "--label", TOKEN_LABEL]
    _run([*command, "--pin", PIN, "--so-pin", "so-" + PIN], env)
    pin_file = directory / "pin"
    pin_file.write_text(PIN + "\n")
    pin_file.chmod(0o600)
    return {
        "SOFTHSM2_CONF": str(conf),
        "CRYPTD_PKCS11_MODULE": str(SOFTHSM_MODULE),
        "CRYPTD_PKCS11_TOKEN_LABEL": TOKEN_LABEL,
        "CRYPTD_PKCS11_PIN_FILE": str(pin_file),
    }


def sealed_server(
    seal: str,
    directory: Path,
    *,
    cpus: frozenset[int] | None = None,
    env: dict[str, str] | None = None,
    workers: int = 1,
    prepare: Callable[[Path], None] | None = None,
) -> Cryptd:
    """A server (not started) whose master key the seal ``seal`` keeps; ``env``: more
    settings, the same for every seal; ``prepare(dev)``: called on the development state
    (``master.key`` still there) before the seal takes the key."""
    if seal not in SEALS:
        raise ValueError(f"unknown seal {seal!r} (one of {', '.join(SEALS)})")
    dev = directory / "dev"
    _run([sys.executable, "-c", _PREPARE, str(dev)], _clean_env())
    if prepare is not None:
        prepare(dev)
    master = dev / "master.key"
    settings = {
        "CRYPTD_ENV": "development",
        "CRYPTD_TLS": "off",
        "CRYPTD_KEYRING_FILE": str(dev / "keyring.json"),
        "CRYPTD_CLIENTS_FILE": str(dev / "clients.json"),
        "CRYPTD_REPLAY_DIR": str(directory / "replay"),
        "CRYPTD_SEAL": seal,
        **(env or {}),
    }
    if seal == "static":
        settings["CRYPTD_MASTER_KEY_FILE"] = str(master)
        return Cryptd(directory, workers, settings, cpus, dev=False, name=seal)
    settings["CRYPTD_SEALED_MASTER_KEY_FILE"] = str(directory / "sealed-master-key.json")
    if seal == "pkcs11":
        settings.update(_softhsm_token(directory))
    init = [sys.executable, "-m", "service", "operator", "init", "--master-key-file", str(master)]
    if seal == "shamir":
        init += ["--shares", "3", "--threshold", "2", "--json"]
    printed = _run(init, {**_clean_env(), **settings})
    master.unlink()  # from here on only the seal gives the key
    server = Cryptd(directory, workers, settings, cpus, dev=False, name=seal)
    if seal == "shamir":
        shares = orjson.loads(printed)["shares"][:2]
        server.unseal = lambda started: _unseal(started, shares)
    return server


def _unseal(server: Cryptd, shares: list[str]) -> None:
    from service.cli.unseal import submit_everywhere

    for share in shares:
        report = submit_everywhere(server.directory / "dev" / "client.json", share, url=server.url)
        if not report.ok:
            raise RuntimeError(f"unsealing {server.url} failed: {report.body()}")
