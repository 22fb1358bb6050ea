"""``cryptd bench``: the key types on this machine, SM2 and the post-quantum ones against
RSA-2048, ECDSA-P256, Ed25519 (and gmssl for SM2).

Prints the post-quantum tables (ML-DSA, ML-KEM and X-Wing against RSA-2048, ECDSA-P256, Ed25519
and SM2 through cryptd's key handles: ops/s per operation and its ratio to RSA-2048's, the
signature, token and public-key sizes),
the origin article's table (keygen, encrypt, decrypt, sign, verify in ops/s on one core,
with SM2/RSA-2048 and SM2/gmssl ratios), the effect of the payload size, the SM2 speed-up on
several threads and SM2 against its references; ``--pq-only`` / ``--no-pq`` keep one part;
``--json`` gives the same figures as JSON, ``--chart FILE.png`` draws them (the ``charts``
extra).

The benchmark itself lives beside the product, in the source checkout's ``loadtest`` package:
this command checks its arguments and runs ``python -m loadtest.algorithms`` with them, so the
service never imports benchmark code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

BENCHMARK_MODULE = "loadtest.algorithms"


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("sizes are comma-separated byte counts") from None
    if any(size < 1 or size > 1 << 20 for size in sizes):
        raise argparse.ArgumentTypeError("each size must be between 1 and 1048576 bytes")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options; ``python -m loadtest.algorithms`` declares the same ones."""
    parser.add_argument("--seconds", type=float, default=1.0, help="time per figure (default: 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="payload sizes in bytes, comma-separated (default: 16,128,1024,8192)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="also run SM2 on this many threads (default: 2; 1 skips)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="slices per figure, alternating with its rivals (default: 3)",
    )
    parser.add_argument("--no-gmssl", action="store_true", help="skip the gmssl reference")
    part = parser.add_mutually_exclusive_group()
    part.add_argument(
        "--pq-only", action="store_true", help="only the post-quantum key-type tables"
    )
    part.add_argument("--no-pq", action="store_true", help="skip the post-quantum key types")
    parser.add_argument(
        "--chart",
        type=Path,
        metavar="FILE.png",
        help="also draw the figures as a PNG chart (needs the charts extra: matplotlib)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each figure on stderr")


def require_charts(what: str = "--chart") -> None:
    """Refuse a chart before any work when matplotlib cannot be imported (missing, or broken),
    rather than fail after the whole benchmark. What the chart code imports, so the check
    fails exactly when drawing would."""
    try:
        importlib.import_module("matplotlib")
        importlib.import_module("matplotlib.figure")
    except Exception as exc:  # any import failure: ImportError, or a broken install's own
        raise OSError(
            f"{what} needs matplotlib, which cannot be imported here"
            f" ({type(exc).__name__}): pip install 'cryptd[charts]'"
        ) from None


def check(args: argparse.Namespace) -> None:
    """Refuse what argparse cannot, and a chart without matplotlib, before anything is
    measured."""
    if args.seconds <= 0:
        raise ValueError("--seconds must be positive")
    if args.rounds < 1 or args.threads < 1:
        raise ValueError("--rounds and --threads must be at least 1")
    if args.chart is not None:
        require_charts()


def _passed_on(args: argparse.Namespace) -> list[str]:
    argv = ["--seconds", repr(args.seconds), "--threads", str(args.threads)]
    argv += ["--rounds", str(args.rounds)]
    if args.sizes is not None:
        argv += ["--sizes", ",".join(str(size) for size in args.sizes)]
    if args.chart is not None:
        argv += ["--chart", str(args.chart)]
    flags = {
        "--json": args.json,
        "--no-gmssl": args.no_gmssl,
        "--verbose": args.verbose,
        "--pq-only": args.pq_only,
        "--no-pq": args.no_pq,
    }
    return argv + [flag for flag, given in flags.items() if given]


def _checkout_root() -> Path | None:
    """The directory holding the ``loadtest`` package, found as ``python -m`` would find it from
    here (the working directory first), without importing it."""
    spec = importlib.machinery.PathFinder.find_spec("loadtest", [os.getcwd(), *sys.path])
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def handle(args: argparse.Namespace) -> int:
    check(args)
    root = _checkout_root()
    if root is None:
        raise OSError(
            "the benchmark is not installed: run cryptd bench from a source checkout "
            "(it runs python -m loadtest.algorithms)"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", BENCHMARK_MODULE, *_passed_on(args)]
    # stdout is relayed (callers may have replaced sys.stdout); progress goes straight to stderr
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, check=False)
    sys.stdout.write(done.stdout.decode())
    return done.returncode


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure SM2 and the post-quantum key types against RSA-2048, ECDSA-P256 and"
        " Ed25519 on this machine",
        description=__doc__,
    )
    add_arguments(parser)
    parser.set_defaults(func=handle)
