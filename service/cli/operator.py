"""``cryptd operator init|unseal``: set up the seal that keeps the master key (CRYPTD_SEAL),
and unseal a server started sealed.

- ``static``: a new random master key in the file ``CRYPTD_MASTER_KEY_FILE`` names (mode 0600).
- ``pkcs11``: the token's AES-256 seal key (created when absent, never extractable) and the
  master key sealed under it in ``CRYPTD_SEALED_MASTER_KEY_FILE`` (default: beside the
  keyring file). ``--master-key-file`` seals an existing master key instead of a fresh one:
  a static deployment moves to the token without rewrapping any key version.
- ``transit``: the master key wrapped by the Transit key (OpenBao/Vault, or another cryptd)
  in ``CRYPTD_SEALED_MASTER_KEY_FILE``; ``--master-key-file`` wraps an existing one.
- ``shamir``: ``--shares N --threshold K`` splits a new master key into N SLIP-39 shares
  printed once (one per line, or ``--json``); only the split's public facts are written.

Then ``cryptd keystore init`` creates the key store under that master key, as before.

``rotate-master-key`` makes a new master key where the seal keeps it and rewraps every key
version under it, while the service keeps serving (service/seal/rotation.py); for ``shamir``
it takes the current shares on stdin and prints the new ones once.

``seal-migrate --to SEAL`` keeps the same master key under another seal; the key store is not
touched (service/seal/migrate.py).
"""

from __future__ import annotations

import argparse
import base64
import secrets
import sys
import time
from pathlib import Path

import orjson

from service.cli.call import default_credential
from service.config import SealSettings, decode_master_key
from service.fileio import atomic_write
from service.keys.masterkey import MasterKey
from service.seal import SealError


def _print(data: object) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def _existing_master_key(path: str | None) -> bytes | None:
    return None if path is None else decode_master_key(Path(path).read_text(), path)


def init(args: argparse.Namespace) -> int:
    settings = SealSettings()
    existing = _existing_master_key(args.master_key_file)
    if (args.shares is None) != (args.threshold is None):
        raise SealError("--shares and --threshold go together")
    if settings.seal == "shamir":
        if args.shares is None:
            raise SealError("CRYPTD_SEAL=shamir: give --shares N --threshold K")
        return _init_shamir(settings, args, existing)
    if args.shares is not None:
        raise SealError("--shares and --threshold split the key for CRYPTD_SEAL=shamir only")
    if settings.seal == "pkcs11":
        from service.seal.pkcs11 import Pkcs11Seal

        seal = Pkcs11Seal.from_settings(settings)
        try:
            report = seal.init(existing)
        finally:
            seal.close()
        _print(
            {
                "seal": "pkcs11",
                "token_label": seal.token_label,
                "key_label": seal.key_label,
                "token_key_created": report.token_key_created,
                "sealed_master_key_file": str(report.sealed_file),
                "master_key_id": report.key_id,
            }
        )
        return 0
    if settings.seal == "transit":
        return _init_transit(settings, existing)
    return _init_static(settings, existing)


def _init_transit(settings: SealSettings, existing: bytes | None) -> int:
    from service.seal.transit import TransitSeal

    seal = TransitSeal.from_settings(settings)
    try:
        report = seal.init(existing)
        _print(
            {
                "seal": "transit",
                "transit_address": seal.backend.address,
                "transit_key": seal.key_label,
                "transit_key_version": report.key_version,
                "sealed_master_key_file": str(report.sealed_file),
                "master_key_id": report.key_id,
            }
        )
    finally:
        seal.close()
    return 0


def _init_shamir(settings: SealSettings, args: argparse.Namespace, existing: bytes | None) -> int:
    from service.seal.shamir import split

    path = settings.sealed_master_key_path()
    shares = split(path, args.shares, args.threshold, existing)
    # Shown once, stored nowhere: each line goes to one operator.
    if args.json:
        _print({"shares": shares})
    else:
        sys.stdout.write("".join(share + "\n" for share in shares))
    print(
        f"cryptd: {args.shares} shares printed once; any {args.threshold} unseal the service. "
        f"Split recorded in {path}.",
        file=sys.stderr,
    )
    return 0


def _init_static(settings: SealSettings, existing: bytes | None) -> int:
    if settings.master_key is not None:
        raise SealError(
            "CRYPTD_SEAL=static with CRYPTD_MASTER_KEY set: the master key already exists "
            "(in the environment); nothing to initialise"
        )
    path = settings.master_key_file
    if path is None:
        raise SealError("CRYPTD_SEAL=static: set CRYPTD_MASTER_KEY_FILE to where the key goes")
    if path.exists():
        raise SealError(f"{path} already exists: the master key is there")
    master = secrets.token_bytes(32) if existing is None else existing
    atomic_write(path, base64.b64encode(master) + b"\n", mode=0o600)
    key_id = MasterKey(master).key_id
    _print({"seal": "static", "master_key_file": str(path), "master_key_id": key_id})
    return 0


def rotate_master_key(args: argparse.Namespace) -> int:
    from service.cli.keys import store_from_args
    from service.keys.manager import KeyManager
    from service.seal.rotation import refuse_unless_file, rotate

    settings = SealSettings()
    if settings.seal == "shamir":
        return _rotate_shamir(settings, args)
    files = refuse_unless_file(settings)  # before anything is opened: say why at once
    seal = getattr(files, "seal", None)
    if args.rotate_transit_key:
        if settings.seal != "transit":
            raise SealError("--rotate-transit-key is for CRYPTD_SEAL=transit")
        assert seal is not None  # SealedKeyFiles of the transit seal
        seal.rotate_key()  # the new master key is wrapped by the new version
    store = store_from_args(args)
    try:
        manager = KeyManager(store, files.current(), lookup=files)
        manager.load()
        report = rotate(settings, manager.snapshot, seal)
    finally:
        store.close()
        if seal is not None:
            seal.close()
    _print(report.body())
    print(
        f"cryptd: every key version rewrapped under master key {report.master_key_id}; the "
        f"previous key is kept in {files.retired}* for backups made before (docs/DEPLOY.md)",
        file=sys.stderr,
    )
    return 0


def _rotate_shamir(settings: SealSettings, args: argparse.Namespace) -> int:
    """The current shares on stdin (as a sealed start takes them); the new split's shares
    printed once, before the store is rewrapped under its key, so a rotation that commits
    never leaves a key whose shares nobody saw."""
    from service.cli.keys import store_from_args
    from service.keys.manager import KeyManager
    from service.seal import unseal_once
    from service.seal.rotation import LOCK, rotate
    from service.seal.shamir_rotation import ShamirKeyFiles

    path = settings.sealed_master_key_path()
    master = unseal_once(settings)
    files = ShamirKeyFiles(path, master)
    files.handover_seconds = args.handover_seconds
    store = store_from_args(args)
    try:
        manager = KeyManager(store, MasterKey(master), lookup=files)
        manager.load()
        files.on_staged = lambda shares: _print_new_shares(shares, args.json)
        report = rotate(settings, manager.snapshot, files=files)
        if args.json:
            sys.stdout.write(orjson.dumps(report.body()).decode() + "\n")
            sys.stdout.flush()
        print(
            f"cryptd: every key version rewrapped under master key {report.master_key_id}; the "
            f"shares printed above unseal it from now on, the previous ones are refused "
            f"({path}; docs/DEPLOY.md). Running processes move to it within "
            f"{args.handover_seconds:g} s; the hand-over is removed then",
            file=sys.stderr,
        )
        # Running processes holding the previous key find the new one through the hand-over
        # until it goes: then the old shares lead nowhere.
        time.sleep(args.handover_seconds)
        with store.try_lock(LOCK) as held:
            if held:  # else another rotation runs: its new split carries no hand-over of ours
                files.drop_handover()
    finally:
        store.close()
    return 0


def _print_new_shares(shares: list[str], as_json: bool) -> None:
    # Shown once, stored nowhere: each line goes to one operator.
    if as_json:
        sys.stdout.write(orjson.dumps({"shares": shares}).decode() + "\n")
    else:
        sys.stdout.write("".join(share + "\n" for share in shares))
    sys.stdout.flush()
    print(
        f"cryptd: {len(shares)} new shares printed once; they unseal the service once this "
        "rotation reports success (until then, the previous shares still do)",
        file=sys.stderr,
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("operator", help="the seal that keeps the master key (CRYPTD_SEAL)")
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser(
        "init",
        help="create the seal's key and the sealed master key (pkcs11), the wrapped master key "
        "(transit), the shares (shamir), or the master key file (static)",
    )
    p.add_argument(
        "--master-key-file",
        help="seal this existing base64 master key instead of a new one (moving a static "
        "deployment to another seal; the key stores stay as they are)",
    )
    p.add_argument("--shares", type=int, help="shamir: how many shares to make (at most 16)")
    p.add_argument("--threshold", type=int, help="shamir: how many shares unseal")
    p.add_argument("--json", action="store_true", help='shamir: print {"shares": [...]}')
    p.set_defaults(func=init)

    p = actions.add_parser(
        "unseal",
        help="submit one Shamir share to every worker of a sealed server",
        description="The share is read from the argument, or from stdin when it is omitted or "
        "'-' (preferred: an argument is visible in the process list and shell history). "
        "Signed with the credential's client, which must be an admin.",
    )
    p.add_argument("share", nargs="?", default="-", help="the share's words, or - for stdin")
    p.add_argument(
        "--credential",
        type=Path,
        help="credential JSON {url, client_id, secret[, ca_file, cert_file, key_file]} (default: "
        "$CRYPTD_DEV_DIR/client.json or ./.cryptd-dev/client.json)",
    )
    p.add_argument("--url", help="override the URL of the credential file")
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to reach every worker (default 30)"
    )
    p.set_defaults(func=unseal)

    p = actions.add_parser(
        "rotate-master-key",
        help="make a new master key and rewrap every key version under it, online",
        description="static seal: the new key replaces the file CRYPTD_MASTER_KEY_FILE "
        "names (atomically; the old one is kept in <file>.retired for older backups). pkcs11: "
        "the new key sealed by the same token key replaces the sealed file (the old one kept "
        "as <file>.retired-<key id>); transit: the same, wrapped by the Transit key's latest "
        "version. shamir: the current shares are read on stdin, a new split with the same N "
        "and K is printed once, and the old shares are refused from then on. Every worker of "
        "every replica moves to the new key as "
        "it sees the store change.",
    )
    p.add_argument("--keyring", help="keyring file (default: $CRYPTD_KEYRING_FILE)")
    p.add_argument("--keystore-url", help="PostgreSQL key store (default: $CRYPTD_KEYSTORE_URL)")
    p.add_argument(
        "--rotate-transit-key",
        action="store_true",
        help="transit: first make a new version of the Transit key (the token needs update on "
        "<mount>/keys/<key>/rotate); without it the new master key is wrapped by the key's "
        "latest version as it is",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='shamir: print {"shares": [...]} then the report, one JSON object per line',
    )
    p.add_argument(
        "--handover-seconds",
        type=float,
        default=120.0,
        help="shamir: how long running processes holding the previous key can find the new "
        "one (the command waits, then removes the hand-over; default 120)",
    )
    p.set_defaults(func=rotate_master_key)

    p = actions.add_parser(
        "seal-migrate",
        help="keep the same master key under another seal (the key store is not rewritten)",
        description="The old seal is the one the environment names (CRYPTD_SEAL and its "
        "settings); the new seal takes its settings from the same environment "
        "(CRYPTD_PKCS11_*, CRYPTD_TRANSIT_*). The new seal's file is written and opened "
        "again before anything else; a file both seals use is replaced atomically, the old "
        "one copied to <file>.from-<old seal>. Run it again after an interruption: it "
        "finishes. Then set CRYPTD_SEAL to the new seal and restart every replica.",
    )
    p.add_argument("--to", required=True, choices=["static", "pkcs11", "transit", "shamir"])
    p.add_argument(
        "--master-key-file", type=Path, help="--to static: where the key goes (mode 0600)"
    )
    p.add_argument(
        "--sealed-file",
        type=Path,
        help="the new seal's file (default: CRYPTD_SEALED_MASTER_KEY_FILE, or beside the "
        "keyring file)",
    )
    p.add_argument("--shares", type=int, help="--to shamir: how many shares to make")
    p.add_argument("--threshold", type=int, help="--to shamir: how many shares unseal")
    p.add_argument("--keyring", help="keyring file (default: $CRYPTD_KEYRING_FILE)")
    p.add_argument("--keystore-url", help="PostgreSQL key store (default: $CRYPTD_KEYSTORE_URL)")
    p.set_defaults(func=seal_migrate)


def seal_migrate(args: argparse.Namespace) -> int:
    from service.cli.keys import store_from_args
    from service.seal.migrate import migrate, target_settings

    if (args.shares is None) != (args.threshold is None):
        raise SealError("--shares and --threshold go together")
    if args.shares is not None and args.to != "shamir":
        raise SealError("--shares and --threshold split the key for --to shamir only")
    source = SealSettings()
    target = target_settings(
        source, args.to, master_key_file=args.master_key_file, sealed_file=args.sealed_file
    )
    shares = None if args.shares is None else (args.shares, args.threshold)
    store = store_from_args(args)
    try:
        report = migrate(source, target, store, shares=shares)
    finally:
        store.close()
    body = report.body()
    if report.shares:
        body["shares"] = report.shares  # shown once, stored nowhere: one per operator
    _print(body)
    for warning in report.warnings:
        print(f"cryptd: warning: {warning}", file=sys.stderr)
    done = "was already" if report.already else "is now"
    if report.backup is not None:
        old = f"; the old seal's file is kept as {report.backup}"
    elif report.previous is not None:
        old = f"; remove {report.previous} once every replica runs on the new seal"
    else:
        old = "; then unset CRYPTD_MASTER_KEY"
    print(
        f"cryptd: master key {report.master_key_id} {done} kept by the {report.target} seal in "
        f"{report.written}. Set CRYPTD_SEAL={report.target} (and its settings) and restart "
        f"every replica{old}",
        file=sys.stderr,
    )
    return 0


def unseal(args: argparse.Namespace) -> int:
    from service.cli.unseal import submit_everywhere

    share = args.share
    if share == "-":
        if sys.stdin.isatty():
            import getpass

            share = getpass.getpass("unseal share: ")
        else:
            share = sys.stdin.readline()
    share = " ".join(share.split())
    if not share:
        raise SealError("no share given")
    credential = args.credential or default_credential()
    report = submit_everywhere(credential, share, url=args.url, timeout=args.timeout)
    _print(report.body())
    return 0 if report.ok else 1
