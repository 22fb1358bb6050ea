"""``cryptd call <op> [key]``: call a running cryptd (a signed request, or an unsigned one over a
client certificate for a certificate-only client), print JSON.

Over 400 lines because it is the table of every operation's options (which it accepts, which it
refuses) and their mapping onto the client's methods: one declarative list, read top to bottom."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, get_args

from cryptd_client import CryptdAPIError, CryptdClient, CryptdConnectionError, KeyMetadata
from service.cli.keys import read_material, settings_from_args
from service.crypto.registry import KEY_TYPES
from service.operations import OpName

# The service's crypto operations (one list: operations.OpName), and random bytes.
OPERATIONS = (*get_args(OpName), "random")
KEY_COMMANDS = (
    "keys",
    "key",
    "create",
    "update",
    "delete",
    "cancel-deletion",
    "rotate",
    "wrapping-key",
    "import",
    "import-version",
    "backup",
    "restore",
)
# Operations that read their input (plaintext, ciphertext, message) from --data/--data-file/stdin.
_WITH_INPUT = frozenset(
    {
        "encrypt",
        "decrypt",
        "sign",
        "verify",
        "rewrap",
        "hmac",
        "import",
        "import-version",
        "restore",
    }
)
# Operations that name no key.
_KEYLESS = frozenset({"keys", "random", "wrapping-key"})
# The options each operation takes (by argparse dest), beyond --credential and --url: any
# other one given is refused rather than silently ignored.
_INPUT = ("data", "data_file", "base64")
_SIGNING = ("digest", "algorithm", "hash_algorithm", "signer_id", "encoding", "key_version")
_NEW_KEY = ("type", "deletion_allowed", "derived", "convergent")
OPTIONS: dict[str, tuple[str, ...]] = {
    "encrypt": (*_INPUT, "aad", "context", "key_version"),
    "decrypt": (*_INPUT, "aad", "context", "key_version", "format", "raw"),
    "sign": (*_INPUT, *_SIGNING, "context", "message_type"),
    "verify": (*_INPUT, *_SIGNING, "signature", "mac", "context", "message_type"),
    "rewrap": (*_INPUT, "aad", "context", "to_key"),
    "datakey": ("bits", "no_plaintext", "aad", "context"),
    "hmac": (*_INPUT, "key_version", "context"),
    "decapsulate": ("ciphertext", "key_version"),
    "random": ("bytes",),
    "create": _NEW_KEY,
    "update": (
        "deletion_allowed",
        "state",
        "min_decryption_version",
        "min_encryption_version",
        "auto_rotate_period",
    ),
    "import": (*_INPUT, *_NEW_KEY),
    "import-version": _INPUT,
    "restore": _INPUT,
}
_PEM = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----", re.DOTALL)


def default_credential() -> Path:
    """$CRYPTD_CREDENTIAL, else the development server's: $CRYPTD_DEV_DIR/client.json or
    ./.cryptd-dev/client.json."""
    if named := os.environ.get("CRYPTD_CREDENTIAL"):
        return Path(named)
    return Path(os.environ.get("CRYPTD_DEV_DIR", ".cryptd-dev")) / "client.json"


def _missing_credential(path: Path, given: bool) -> str:
    """One line: where the credential was looked for and how to point elsewhere."""
    where = f"{path} ({path.resolve()})" if not path.is_absolute() else str(path)
    if given:
        return f"no credential file at {where}"
    return (
        f"no credential file at {where}: pass --credential FILE or set CRYPTD_CREDENTIAL"
        " (or CRYPTD_DEV_DIR); 'cryptd serve --dev' writes .cryptd-dev/client.json where it"
        " starts"
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "call",
        usage="%(prog)s OPERATION [KEY] [options] (cryptd call -h lists them)",
        help="call a running cryptd (signed request) and print the JSON result",
        description="Input (plaintext, ciphertext token, message, key material to import, "
        "backup to restore) comes from --data, --data-file or stdin. Binary output is base64. "
        "'import' wraps the material here under the server's wrapping key: secret keys as hex "
        "digits or raw bytes, private keys as PKCS#8 (PEM or DER). 'verify' exits 1 when the "
        "signature is not valid; API errors are printed to stderr as JSON with exit status 1. "
        "A 429 or 503 is retried after its Retry-After, signed afresh (up to 3 times, 30 s in "
        "all); key management that changes state is never sent twice.",
    )
    parser.add_argument("op", choices=OPERATIONS + KEY_COMMANDS, help="operation")
    parser.add_argument("key", nargs="?", help="key name (all operations but 'keys', 'random')")
    parser.add_argument(
        "--credential",
        type=Path,
        help="credential JSON {url, client_id, secret} and, for TLS, ca_file, cert_file,"
        " key_file; a client authenticated by its certificate alone has"
        ' "authentication": "certificate" and cert_file instead of a secret'
        " (default: $CRYPTD_CREDENTIAL, else $CRYPTD_DEV_DIR/client.json or"
        " ./.cryptd-dev/client.json)",
    )
    parser.add_argument("--url", help="override the URL of the credential file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", help="input as text (UTF-8)")
    source.add_argument("--data-file", type=Path, help="input from a file (bytes)")
    parser.add_argument(
        "--base64", action="store_true", help="the input is base64: decode it first"
    )
    parser.add_argument("--aad", help="associated data (UTF-8 text)")
    parser.add_argument(
        "--context", help="derived keys: the context; sign/verify (ML-DSA): the FIPS 204 context"
    )
    parser.add_argument(
        "--message-type", help="sign/verify (ML-DSA): raw | external_mu (input: the 64-byte mu)"
    )
    parser.add_argument("--key-version", type=int)
    parser.add_argument("--format", help="decrypt: external ciphertext format (input is bytes)")
    parser.add_argument("--digest", help="sign/verify: the digest, hex, instead of a message")
    parser.add_argument("--signature", help="verify: the signature, base64")
    parser.add_argument("--mac", help="verify: the MAC (cryptd:v<N>:...) of an HMAC key")
    parser.add_argument("--algorithm", help="sign/verify: pss | pkcs1v15 (RSA)")
    parser.add_argument(
        "--hash-algorithm", help="sign/verify: sha2-256 | sha2-384 | sha2-512 (RSA, ECDSA)"
    )
    parser.add_argument("--signer-id", help="sign/verify: SM2 signer ID")
    parser.add_argument("--encoding", help="sign/verify: der | raw (ECDSA, SM2)")
    parser.add_argument("--to-key", help="rewrap: re-encrypt under this key")
    parser.add_argument(
        "--ciphertext", help="decapsulate: the KEM ciphertext, base64 (as encapsulate prints it)"
    )
    parser.add_argument("--bits", type=int, help="datakey: 128 or 256 (default: 256)")
    parser.add_argument(
        "--no-plaintext", action="store_true", help="datakey: return the wrapped key only"
    )
    parser.add_argument("--bytes", type=int, help="random: how many, 1 to 65536 (default: 32)")
    parser.add_argument("--type", help="create: key type, e.g. aes256-gcm")
    parser.add_argument(
        "--deletion-allowed",
        nargs="?",
        const=True,
        default=None,
        type=_flag,
        metavar="true|false",
        help="create, import: may be deleted; update: true or false",
    )
    parser.add_argument(
        "--state", help="update: enabled | decrypt_only | disabled (DELETE schedules deletion)"
    )
    parser.add_argument("--min-decryption-version", type=int, help="update")
    parser.add_argument(
        "--min-encryption-version", type=int, help="update: 0 (none) or a key version"
    )
    parser.add_argument("--auto-rotate-period", type=int, help="update: seconds (0: off)")
    parser.add_argument("--derived", action="store_true", help="create: a key per context (HKDF)")
    parser.add_argument(
        "--convergent",
        action="store_true",
        help="create: deterministic encryption (with --derived; see docs/FORMAT.md)",
    )
    parser.add_argument(
        "--raw", action="store_true", help="decrypt: write the plaintext bytes, not JSON"
    )
    parser.set_defaults(func=_call, parser=parser)


def _refuse_unused(args: argparse.Namespace) -> None:
    """Refuse, as a usage error, a key or an option the operation does not take."""
    parser: argparse.ArgumentParser = args.parser
    op: str = args.op
    if op in _KEYLESS and args.key is not None:
        parser.error(f"'{op}' takes no key name (got {args.key!r})")
    allowed = set(OPTIONS.get(op, ()))
    for action in parser._actions:
        if not action.option_strings or action.dest in allowed:
            continue
        if action.dest in ("help", "credential", "url"):
            continue
        value = getattr(args, action.dest, None)
        # Flags default to False, every other option to None: anything else was given.
        unset = False if isinstance(action, argparse._StoreTrueAction) else None
        if value is not unset:
            takes = ", ".join(_option(parser, dest) for dest in OPTIONS.get(op, ())) or "none"
            parser.error(f"'{op}' does not take {action.option_strings[-1]} (its options: {takes})")


def _option(parser: argparse.ArgumentParser, dest: str) -> str:
    return next(a.option_strings[-1] for a in parser._actions if a.dest == dest)


def _flag(text: str) -> bool:
    value = {"true": True, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError("expected true or false")
    return value


def _read_input(args: argparse.Namespace) -> bytes:
    if args.data is not None:
        data: bytes = args.data.encode("utf-8")
    elif args.data_file is not None:
        data = Path(args.data_file).read_bytes()
    else:
        data = sys.stdin.buffer.read()
    if args.base64:
        try:
            data = base64.b64decode(data, validate=False)
        except binascii.Error:
            raise ValueError("input is not valid base64") from None
    return data


def wire_material(data: bytes, type_name: str) -> bytes:
    """Key material as the import route takes it: raw bytes for secret keys (read from hex or
    raw), PKCS#8 DER for private keys (read from a PEM 'PRIVATE KEY' block or DER)."""
    if type_name not in KEY_TYPES:
        raise ValueError(f"unknown key type {type_name!r}")
    if not KEY_TYPES[type_name].asymmetric:
        return read_material(data, type_name)
    match = _PEM.search(data)
    if match is None:
        return data
    if match.group(1) != b"PRIVATE KEY":
        raise ValueError("convert the key to PKCS#8 first (openssl pkcs8 -topk8 -nocrypt)")
    try:
        return base64.b64decode(b"".join(match.group(2).split()), validate=True)
    except binascii.Error:
        raise ValueError("the PEM block is not valid base64") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _new_key_settings(args: argparse.Namespace, op: str) -> tuple[str, dict[str, bool]]:
    """The type (required) and the settings of the key ``create`` or ``import`` makes."""
    if not args.type:
        raise ValueError(f"{op} needs --type")
    settings = {
        "deletion_allowed": bool(args.deletion_allowed),
        "derived": args.derived,
        "convergent": args.convergent,
    }
    return args.type, settings


def _metadata(meta: KeyMetadata) -> dict[str, Any]:
    return dict(meta.raw)


def _sign_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "digest": bytes.fromhex(args.digest) if args.digest else None,
        "algorithm": args.algorithm,
        "signer_id": args.signer_id,
        "encoding": args.encoding,
        "key_version": args.key_version,
        "hash_algorithm": args.hash_algorithm,
        "context": args.context.encode("utf-8") if args.context is not None else None,
        "message_type": args.message_type,
    }


def _execute(client: CryptdClient, args: argparse.Namespace) -> tuple[Any, int]:
    """Run the operation; return (JSON-able result, exit status)."""
    op: str = args.op
    key: str = args.key
    aad = args.aad.encode("utf-8") if args.aad is not None else None
    context = args.context.encode("utf-8") if args.context is not None else None
    # sign / verify with --digest send no message, so they read no input.
    needs_input = op in _WITH_INPUT and not (op in ("sign", "verify") and args.digest)
    data = _read_input(args) if needs_input else b""
    if op == "encrypt":
        enc = client.encrypt(key, data, aad=aad, key_version=args.key_version, context=context)
        return {"ciphertext": enc.ciphertext, "key_version": enc.key_version}, 0
    if op == "decrypt":
        ciphertext: str | bytes = data if args.format else data.decode("ascii").strip()
        dec = client.decrypt(
            key,
            ciphertext,
            aad=aad,
            format=args.format,
            key_version=args.key_version,
            context=context,
        )
        if args.raw:
            sys.stdout.buffer.write(dec.plaintext)
            sys.stdout.buffer.flush()
            return None, 0
        return {"plaintext": _b64(dec.plaintext), "key_version": dec.key_version}, 0
    if op == "sign":
        signed = client.sign(key, None if args.digest else data, **_sign_options(args))
        return {"signature": _b64(signed.signature), "key_version": signed.key_version}, 0
    if op == "verify" and args.mac:
        valid = client.verify_mac(
            key, data, args.mac, key_version=args.key_version, context=context
        )
        return {"valid": valid}, 0 if valid else 1
    if op == "verify":
        if not args.signature:
            raise ValueError("verify needs --signature (base64) or --mac")
        valid = client.verify(
            key,
            None if args.digest else data,
            signature=base64.b64decode(args.signature, validate=True),
            **_sign_options(args),
        )
        return {"valid": valid}, 0 if valid else 1
    if op == "rewrap":
        token = data.decode("ascii").strip()
        rewrapped = client.rewrap(key, token, aad=aad, to_key=args.to_key, context=context)
        return {"ciphertext": rewrapped.ciphertext, "key_version": rewrapped.key_version}, 0
    bits = 256 if args.bits is None else args.bits
    if op == "datakey" and args.no_plaintext:
        wrapped = client.datakey_wrapped(key, bits=bits, aad=aad, context=context)
        return {"ciphertext": wrapped.ciphertext, "key_version": wrapped.key_version}, 0
    if op == "datakey":
        dk = client.datakey(key, bits=bits, aad=aad, context=context)
        result = {"plaintext": _b64(dk.plaintext), "ciphertext": dk.ciphertext}
        return {**result, "key_version": dk.key_version}, 0
    if op == "hmac":
        mac = client.hmac(key, data, key_version=args.key_version, context=context)
        return {"mac": mac.mac, "key_version": mac.key_version}, 0
    if op == "encapsulate":
        made = client.encapsulate(key)
        secret = _b64(made.shared_secret)
        result = {"ciphertext": _b64(made.ciphertext), "shared_secret": secret}
        return {**result, "key_version": made.key_version}, 0
    if op == "decapsulate":
        if not args.ciphertext:
            raise ValueError("decapsulate needs --ciphertext (base64)")
        try:
            kem_ciphertext = base64.b64decode(args.ciphertext, validate=True)
        except binascii.Error:
            raise ValueError("--ciphertext is not valid base64") from None
        opened = client.decapsulate(key, kem_ciphertext, key_version=args.key_version)
        return {"shared_secret": _b64(opened.shared_secret), "key_version": opened.key_version}, 0
    if op == "random":
        size = 32 if args.bytes is None else args.bytes
        return {"random": _b64(client.random(size))}, 0
    if op == "keys":
        return {"keys": [_metadata(m) for m in client.list_keys()]}, 0
    if op == "key":
        return _metadata(client.get_key(key)), 0
    if op == "create":
        type_name, settings = _new_key_settings(args, op)
        return _metadata(client.create_key(key, type_name, **settings)), 0
    if op == "update":
        return _metadata(client.update_key(key, **settings_from_args(args))), 0
    if op == "delete":
        pending = client.delete_key(key)
        # Deleted at once: {"deleted": name}; scheduled: the pending key's metadata.
        return ({"deleted": key} if pending is None else _metadata(pending)), 0
    if op == "cancel-deletion":
        return _metadata(client.cancel_deletion(key)), 0
    if op == "rotate":
        return _metadata(client.rotate_key(key)), 0
    if op == "wrapping-key":
        return {"public_key": client.wrapping_key()}, 0
    if op == "import":
        type_name, settings = _new_key_settings(args, op)
        imported = client.import_key(key, type_name, wire_material(data, type_name), **settings)
        return _metadata(imported), 0
    if op == "import-version":
        type_name = client.get_key(key).type
        return _metadata(client.import_key_version(key, wire_material(data, type_name))), 0
    if op == "backup":
        return {"backup": client.backup_key(key)}, 0
    if op == "restore":
        return _metadata(client.restore_key(key, data.decode("ascii").strip())), 0
    raise ValueError(f"unknown operation {op!r}")


def _call(args: argparse.Namespace) -> int:
    _refuse_unused(args)
    if args.op not in _KEYLESS and not args.key:
        raise ValueError(f"'{args.op}' needs a key name")
    credential = Path(args.credential) if args.credential else default_credential()
    if not credential.is_file():
        raise ValueError(_missing_credential(credential, given=args.credential is not None))
    try:
        # TLS files named in the credential (https://) are taken relative to its directory; a
        # certificate-only credential has cert_file and no secret (requests go unsigned).
        with CryptdClient.from_file(credential, url=args.url) as client:
            result, status = _execute(client, args)
    except CryptdAPIError as exc:
        error = {
            "status": exc.status,
            "code": exc.code,
            "message": exc.message,
            "request_id": exc.request_id,
        }
        print(json.dumps({"error": error}), file=sys.stderr)
        return 1
    except CryptdConnectionError as exc:
        print(f"cryptd: error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps(result, indent=2))
    return status
