"""The ``cryptd`` command. Each subcommand lives in its own module with a ``register`` function."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from service.crypto.base import CryptoError
from service.errors import CryptdError
from service.keys.store import KeystoreError

# Modules that add subcommands; each defines register(subparsers) and sets ``func`` on its parser.
_COMMAND_MODULES = (
    "serve",
    "keys",
    "keystore",
    "master_key",
    "clients",
    "call",
    "bench",
    "migrate",
    "audit",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cryptd", description="cryptd encryption service")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"service.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"service.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (CryptdError, CryptoError, KeystoreError) as exc:
        print(f"cryptd: error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        # pydantic's own text quotes the input, which holds every setting (a master key too).
        for error in exc.errors(include_url=False, include_context=False, include_input=False):
            where = ".".join(str(part) for part in error["loc"])
            print(f"cryptd: error: {where + ': ' if where else ''}{error['msg']}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"cryptd: error: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
