"""The ``cryptd`` command. Each subcommand lives in its own module with a ``register`` function."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from service import __version__
from service.crypto.base import CryptoError
from service.errors import CryptdError
from service.keys.store import KeystoreError

# Modules that add subcommands; each defines register(subparsers) and sets ``func`` on its parser.
_COMMAND_MODULES = (
    "serve",
    "keys",
    "keystore",
    "master_key",
    "operator",
    "clients",
    "call",
    "bench",
    "migrate",
    "completion",
    "audit",
)


def version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    try:
        return importlib.metadata.version("cryptd")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cryptd", description="cryptd encryption service")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"service.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"service.cli.{name}":
                raise
            continue
        module.register(sub)
    parser.set_defaults(root_parser=parser)  # for `cryptd completion`
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _group_without_action(
    parser: argparse.ArgumentParser, arguments: Sequence[str]
) -> argparse.ArgumentParser | None:
    """The parser whose help answers ``arguments``: the root's for none, a command group's
    (``cryptd keys``) for its name alone; None when there is a command to run."""
    if not arguments:
        return parser
    if len(arguments) == 1:
        command = _subcommands(parser).get(arguments[0])
        if command is not None and _subcommands(command):
            return command
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = sys.argv[1:] if argv is None else list(argv)
    group = _group_without_action(parser, arguments)
    if group is not None:
        # No command (or a group such as `cryptd keys` without its action): the overview
        # rather than a one-line usage error; still the usage-error status, as nothing ran.
        group.print_help()
        return 2
    args = parser.parse_args(arguments)
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
