"""``cryptd clients add | list | remove``: edit the clients file (``CRYPTD_CLIENTS_FILE``)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.auth.clients import (
    CLIENT_ID_RE,
    ClientsFileError,
    generate_secret,
    parse_allow_spec,
    parse_client,
    parse_clients,
    read_document,
    show_certificate_identity,
    write_document,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("clients", help="manage API clients (the clients file)")

    def usage(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)
    sub = parser.add_subparsers(dest="clients_command", metavar="ACTION")

    file_help = "clients file (default: $CRYPTD_CLIENTS_FILE)"
    add = sub.add_parser("add", help="add a client and print its new secret once")
    add.add_argument("client_id", help="client id, [A-Za-z0-9_.-]{1,64}")
    add.add_argument("--admin", action="store_true", help="may create, rotate, update, delete keys")
    add.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="GLOB:OPS",
        help="allow operations on matching keys, e.g. 'billing-*:encrypt,decrypt' (repeatable); "
        "operations: encrypt decrypt sign verify rewrap datakey hmac read, random (names no "
        "key: any glob), or *",
    )
    add.add_argument(
        "--certificate",
        action="append",
        default=[],
        metavar="IDENTITY",
        help="mutual TLS: a client certificate identity it may present, a SAN URI "
        "(spiffe://... or URI:...) or DNS name (name or DNS:name) (repeatable); its signed "
        "requests must then come over one",
    )
    add.add_argument(
        "--certificate-only",
        action="store_true",
        help="authenticated by its certificate alone: no secret, no signature "
        "(needs --certificate)",
    )
    add.add_argument("--file", type=Path, help=file_help)
    add.set_defaults(func=_add)

    lst = sub.add_parser("list", help="list clients and their permissions (no secrets)")
    lst.add_argument("--file", type=Path, help=file_help)
    lst.set_defaults(func=_list)

    remove = sub.add_parser("remove", help="remove a client")
    remove.add_argument("client_id")
    remove.add_argument("--file", type=Path, help=file_help)
    remove.set_defaults(func=_remove)


def _path(args: argparse.Namespace) -> Path:
    if args.file is not None:
        return Path(args.file)
    env = os.environ.get("CRYPTD_CLIENTS_FILE")
    if not env:
        raise ValueError("no clients file: give --file or set CRYPTD_CLIENTS_FILE")
    return Path(env)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize edits: two concurrent `clients add` must not lose one of the clients."""
    directory = path.parent if str(path.parent) else Path(".")
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _load_for_edit(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"clients": {}}
    document = read_document(path)
    parse_clients(document)  # refuse to edit (and rewrite) a file that does not load
    return document


def _add(args: argparse.Namespace) -> int:
    path = _path(args)
    client_id: str = args.client_id
    if not CLIENT_ID_RE.fullmatch(client_id):
        raise ValueError(f"client id {client_id!r} must match [A-Za-z0-9_.-]{{1,64}}")
    try:
        allow = [parse_allow_spec(spec) for spec in args.allow]
    except ClientsFileError as exc:
        raise ValueError(str(exc)) from None
    entry: dict[str, Any] = {"admin": args.admin, "allow": allow}
    if args.certificate:
        entry["certificates"] = list(dict.fromkeys(args.certificate))
    secret = None
    if args.certificate_only:
        entry["authentication"] = "certificate"
    else:
        secret = entry["secret"] = generate_secret()
    try:
        parse_client(client_id, entry)  # refuse what the server would refuse to load
    except ClientsFileError as exc:
        raise ValueError(str(exc)) from None
    with _locked(path):
        document = _load_for_edit(path)
        if client_id in document["clients"]:
            print(f"cryptd: client {client_id!r} already exists in {path}", file=sys.stderr)
            return 1
        document["clients"][client_id] = entry
        try:
            parse_clients(document)  # e.g. a certificate identity another client has
        except ClientsFileError as exc:
            raise ValueError(str(exc)) from None
        write_document(path, document)
    if secret is None:
        print(f"client {client_id!r} added to {path}: by certificate", file=sys.stderr)
        return 0
    print(secret)
    print(
        f"client {client_id!r} added to {path}; the secret above is shown only once",
        file=sys.stderr,
    )
    return 0


def _list(args: argparse.Namespace) -> int:
    path = _path(args)
    registry = parse_clients(read_document(path))
    listing = []
    for client in sorted(registry, key=lambda c: c.client_id):
        entry: dict[str, Any] = {
            "client_id": client.client_id,
            "admin": client.admin,
            "allow": [rule.to_json() for rule in client.allow],
        }
        if client.certificates:
            entry["certificates"] = sorted(map(show_certificate_identity, client.certificates))
        if client.certificate_only:
            entry["authentication"] = "certificate"
        listing.append(entry)
    print(json.dumps({"clients": listing}, indent=2))
    return 0


def _remove(args: argparse.Namespace) -> int:
    path = _path(args)
    with _locked(path):
        document = _load_for_edit(path)
        if args.client_id not in document["clients"]:
            print(f"cryptd: no client {args.client_id!r} in {path}", file=sys.stderr)
            return 1
        del document["clients"][args.client_id]
        write_document(path, document)
    print(f"client {args.client_id!r} removed from {path}", file=sys.stderr)
    return 0
