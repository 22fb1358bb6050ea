"""``cryptd completion bash|zsh|tcsh``: print a shell completion script for the whole command,
generated from its argument parser by shtab (the ``completion`` extra), so it never falls
behind a new subcommand or option."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

SHELLS = ("bash", "zsh", "tcsh")
_INSTALL = {
    "bash": "cryptd completion bash > ~/.local/share/bash-completion/completions/cryptd",
    "zsh": "cryptd completion zsh > ~/.zfunc/_cryptd (with ~/.zfunc in $fpath)",
    "tcsh": "cryptd completion tcsh > ~/.cryptd.completion.csh; source it from ~/.tcshrc",
}


def _shtab() -> Any:
    try:
        return importlib.import_module("shtab")
    except ImportError:
        raise OSError("shell completion needs shtab: pip install 'cryptd[completion]'") from None


def _mark_paths(parser: argparse.ArgumentParser, shtab: Any) -> None:
    """Options and arguments that take a path complete file names."""
    for action in parser._actions:
        if action.type is Path:
            action.complete = shtab.FILE  # type: ignore[attr-defined]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _mark_paths(sub, shtab)


def handle(args: argparse.Namespace) -> int:
    shtab = _shtab()
    parser: argparse.ArgumentParser = args.root_parser  # the whole command's parser
    _mark_paths(parser, shtab)
    print(shtab.complete(parser, shell=args.shell))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh or tcsh)",
        description="Print the completion script for SHELL on stdout. Install it with:\n  "
        + "\n  ".join(_INSTALL.values())
        + "\nNeeds the completion extra: pip install 'cryptd[completion]'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shell", choices=SHELLS)
    parser.set_defaults(func=handle)
