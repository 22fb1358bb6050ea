"""``cryptd master-key generate``: a fresh 256-bit master key, base64."""

from __future__ import annotations

import argparse
import base64
import os
import secrets
from pathlib import Path


def _write_secret_file(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600; refuse to overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def generate(args: argparse.Namespace) -> int:
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    if args.out:
        _write_secret_file(Path(args.out), key + "\n")
        print(f"master key written to {args.out}")
    else:
        print(key)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("master-key", help="master key utilities")
    actions = parser.add_subparsers(dest="action", required=True)
    gen = actions.add_parser("generate", help="print (or write) a new random master key")
    gen.add_argument("--out", help="write to this file (mode 0600) instead of printing")
    gen.set_defaults(func=generate)
