"""Instructions per request of each operation in one callgrind run: ``loadtest.instructions``.

The application is built as ``python -m loadtest.hotpath`` builds it (``cryptd serve --dev``'s
state, signing, the host replay store, metrics, the audit log to a file) and driven over ASGI,
``CONCURRENCY`` requests in flight, inside one ``valgrind --tool=callgrind`` process. Each
operation is warmed up, then run twice, ``LOW`` and ``HIGH`` requests, with every request signed
beforehand; a call to ``os.getloadavg()`` (a libc function nothing else here calls) marks the
windows: callgrind is started with ``--dump-before=getloadavg`` and writes the instructions
since the previous mark at each one. ``(HIGH window - LOW window) / (HIGH - LOW)`` is then the
instruction count of one request: start-up, warm-up, signing and every fixed cost of a window
cancel out. Instruction counts do not move with the machine's load, so the figures are a
regression guard a shared CI machine can run (``tests/test_instruction_budget.py`` holds them
to ``loadtest/budgets/instructions-<interpreter>.json``, one file per interpreter) and the way
to compare two trees.

``python -m loadtest.hotpath --record-budget`` re-records the budget; ``--check-budget``
checks this tree against it. Importable: :func:`count` returns the figures of any operations.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import gc
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import orjson

from loadtest.hotpath import Headers, application, prepare, scope_for
from loadtest.scenarios import BATCH_ITEMS, MESSAGE_BYTES, PAYLOAD_BYTES, SECRET_BYTES, payload

LOW: Final = 16
HIGH: Final = 80
WARMUP: Final = 32
CONCURRENCY: Final = 16
# Every run sets the string hash seed: dictionary layouts, and so a few instructions per
# lookup, otherwise change from one run to the next.
HASH_SEED: Final = "0"
BUDGET_DIR: Final = Path(__file__).parent / "budgets"
# The parts that may cost more per request with several server workers, each switched the
# way a worker count switches it (python -m loadtest.scaling compares them): the budget is
# measured with the default, one worker's configuration.
VARIANTS: Final = (
    "default",  # metrics in this process, the host replay store (LMDB)
    "metrics-off",  # CRYPTD_METRICS=false
    "metrics-multiprocess",  # prometheus-client's files, as with several workers
    "replay-memory",  # one process's replay store
    "replay-redis",  # the replay store in Redis (REDIS_URL below)
    "audit-off",  # CRYPTD_AUDIT_LOG=off: the audit trail's cost is default minus this
)
REDIS_URL: Final = os.environ.get("CRYPTD_GUARD_REDIS", "redis://127.0.0.1:6379/11")
# What the counts depend on besides cryptd's code, recorded with the budget.
LIBRARIES: Final = (
    "cryptography",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "orjson",
    "uvloop",
    "prometheus-client",
    "lmdb",
    "http-sfv",
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


_PLAINTEXT = _b64(payload(PAYLOAD_BYTES))
_MESSAGE = _b64(payload(MESSAGE_BYTES))
_SECRET = _b64(payload(SECRET_BYTES))


@dataclass(frozen=True)
class Operation:
    """One request shape. ``setup`` (path, body, answer field) is sent once first when the
    body needs something only the server makes (a ciphertext, a signature); ``build`` turns
    that answer field into the measured body."""

    name: str
    title: str
    method: str
    path: str
    build: Callable[[str | None], dict[str, Any] | None]
    signed: bool = True
    setup: tuple[str, dict[str, Any], str] | None = None
    # Requests of the windows divided by this: an operation of millions of instructions
    # a request needs fewer of them to be counted as exactly, and CI time is callgrind's.
    scale: int = 1

    def windows(self) -> tuple[int, int, int]:
        """(warm-up, low, high) requests."""
        return WARMUP // self.scale, LOW // self.scale, HIGH // self.scale


def _fixed(body: dict[str, Any] | None) -> Callable[[str | None], dict[str, Any] | None]:
    return lambda _answer: body


def _with(field: str, **rest: Any) -> Callable[[str | None], dict[str, Any]]:
    def build(answer: str | None) -> dict[str, Any]:
        if answer is None:
            raise ValueError(f"needs a {field}")
        return {**rest, field: answer}

    return build


OPERATIONS: Final[tuple[Operation, ...]] = (
    Operation(
        "aes-encrypt",
        "AES-256-GCM encrypt 1 KiB",
        "POST",
        "/v1/encrypt/aes256-gcm",
        _fixed({"plaintext": _PLAINTEXT}),
    ),
    Operation(
        "aes-decrypt",
        "AES-256-GCM decrypt 1 KiB",
        "POST",
        "/v1/decrypt/aes256-gcm",
        _with("ciphertext"),
        setup=("/v1/encrypt/aes256-gcm", {"plaintext": _PLAINTEXT}, "ciphertext"),
    ),
    Operation(
        "aes-batch",
        f"AES-256-GCM encrypt batch of {BATCH_ITEMS} x 1 KiB",
        "POST",
        "/v1/encrypt/aes256-gcm",
        _fixed({"batch": [{"plaintext": _PLAINTEXT}] * BATCH_ITEMS}),
        scale=8,
    ),
    Operation(
        "rsa-sign",
        "RSA-2048 sign (PSS, SHA-256)",
        "POST",
        "/v1/sign/rsa-2048",
        _fixed({"message": _MESSAGE, "algorithm": "pss"}),
        scale=4,
    ),
    Operation(
        "rsa-decrypt",
        "RSA-2048 decrypt 32 B",
        "POST",
        "/v1/decrypt/rsa-2048",
        _with("ciphertext"),
        setup=("/v1/encrypt/rsa-2048", {"plaintext": _SECRET}, "ciphertext"),
        scale=4,
    ),
    Operation(
        "ecdsa-sign",
        "ECDSA-P256 sign",
        "POST",
        "/v1/sign/ecdsa-p256",
        _fixed({"message": _MESSAGE}),
    ),
    Operation(
        "ed25519-sign",
        "Ed25519 sign",
        "POST",
        "/v1/sign/ed25519",
        _fixed({"message": _MESSAGE}),
    ),
    Operation(
        "ed25519-verify",
        "Ed25519 verify",
        "POST",
        "/v1/verify/ed25519",
        _with("signature", message=_MESSAGE),
        setup=("/v1/sign/ed25519", {"message": _MESSAGE}, "signature"),
    ),
    Operation(
        "sm2-sign",
        "SM2 sign",
        "POST",
        "/v1/sign/sm2",
        _fixed({"message": _MESSAGE}),
    ),
    Operation(
        "hmac",
        "HMAC-SHA256 of 32 B",
        "POST",
        "/v1/hmac/hmac-sha256",
        _fixed({"message": _MESSAGE}),
    ),
    Operation(
        "signed-random",
        "a signed, replay-checked request with next to no work: 32 random bytes",
        "POST",
        "/v1/random",
        _fixed({"bytes": 32}),
    ),
    Operation(
        "healthz",
        "GET /healthz, unsigned",
        "GET",
        "/healthz",
        _fixed(None),
        signed=False,
    ),
)
BY_NAME: Final = {op.name: op for op in OPERATIONS}


def _json_round_trip(body: bytes) -> bytes:
    # Compact, as the harness's bodies are: the same bytes come back, so the signed digest
    # still matches and only the work is added.
    return json.dumps(json.loads(body), separators=(",", ":")).encode()


# Planted steps: extra work on every request, added by this harness around the application
# (never by the product), to show that the guard names the operation that got slower. An
# operation name "aes-encrypt+json-round-trip" is aes-encrypt with the step planted.
PLANTS: Final[Mapping[str, Callable[[bytes], bytes]]] = {"json-round-trip": _json_round_trip}


def split(name: str) -> tuple[Operation, str]:
    """(the operation, the planted step or "") of an operation name."""
    base, _, plant = name.partition("+")
    if base not in BY_NAME or (plant and plant not in PLANTS):
        raise ValueError(f"unknown operation {name!r}")
    return BY_NAME[base], plant


class _Driver:
    """Requests of one operation, signed beforehand, and the ASGI calls that answer them."""

    def __init__(self, app: Any, credential: dict[str, Any], name: str) -> None:
        op, plant = split(name)
        self.app = app
        self.client_id = credential["client_id"]
        self.secret = base64.b64decode(credential["secret"])
        self.op = op
        self.body = b""
        self.plant = PLANTS[plant] if plant else None
        self.statuses: dict[int, int] = {}

    def headers(self, method: str, path: str, body: bytes) -> Headers:
        from service.auth.signature import sign_request

        raw: Headers = [(b"host", b"127.0.0.1:8080"), (b"user-agent", b"wrk")]
        if method == "POST":
            raw.append((b"content-length", str(len(body)).encode()))
        if self.op.signed:
            signed = sign_request(method, path, "", body, self.client_id, self.secret)
            raw.extend((k.lower().encode(), v.encode()) for k, v in signed.items())
        return raw

    async def call(self, method: str, path: str, body: bytes, headers: Headers) -> bytes:
        plant = self.plant
        delivered = False
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if delivered:
                await asyncio.sleep(3600)  # like a server: nothing more until disconnect
            delivered = True
            return {
                "type": "http.request",
                "body": plant(body) if plant is not None else body,
                "more_body": False,
            }

        async def send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                self.statuses[status] = self.statuses.get(status, 0) + 1
            else:
                chunks.append(message.get("body", b""))

        scope = scope_for(path, headers)
        scope["method"] = method
        await self.app(scope, receive, send)
        return b"".join(chunks)

    async def prepare(self) -> None:
        op = self.op
        answer = None
        if op.setup is not None:
            path, body, field = op.setup
            raw = orjson.dumps(body)
            answer = orjson.loads(
                await self.call("POST", path, raw, self.headers("POST", path, raw))
            )
            answer = answer[field]
        built = op.build(answer)
        self.body = orjson.dumps(built) if built is not None else b""

    def sign(self, count: int) -> list[Headers]:
        return [self.headers(self.op.method, self.op.path, self.body) for _ in range(count)]

    async def drive(self, signed: Sequence[Headers]) -> None:
        loop = asyncio.get_running_loop()
        for start in range(0, len(signed), CONCURRENCY):
            wave = [
                loop.create_task(self.call(self.op.method, self.op.path, self.body, h))
                for h in signed[start : start + CONCURRENCY]
            ]
            await asyncio.gather(*wave)


def _mark() -> None:
    """A window's edge: callgrind writes its counts since the last mark (--dump-before)."""
    os.getloadavg()


async def _settle() -> None:
    # The same state at both edges of every window: the loop's callbacks of the last requests
    # run (metrics batches, audit hand-off) and the collector starts from empty generations.
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()


# Timers that fire by the clock, not per request: under callgrind a window lasts seconds,
# as many or as few as the machine's load makes it, so they would move the counts. Stretched
# beyond any run, they leave only each request's own work.
QUIET_TIMERS: Final = {
    "CRYPTD_USAGE_FLUSH_INTERVAL": "3600",
    "CRYPTD_KEYRING_RELOAD_INTERVAL": "3600",
    "CRYPTD_AUTO_ROTATE_CHECK_INTERVAL": "3600",
    "CRYPTD_AUDIT_CHECKPOINT_INTERVAL": "3600",
}


def _quiet_clock() -> None:
    """The clock-driven work no setting stretches, stretched as QUIET_TIMERS are, in the
    callgrind process only: the loop-lag timer (every 10 ms) and the lifespan's periodic tasks
    (pool gauges every second, store gauges every 5 s). Each of their firings within a window
    was counted, and a window lasts as long as the machine's load makes it: at a load average
    of 11-17 hmac measured 5.1 % and aes-encrypt 2.8 % over a quieter run of the same tree.
    Each request's loop-lag check is unchanged; only the timer behind it ticks no more."""
    from service.api import application as wiring
    from service.pool.lag import LoopLag

    quiet = float(QUIET_TIMERS["CRYPTD_USAGE_FLUSH_INTERVAL"])
    every = wiring._every

    async def stretched(
        interval: float, what: str, action: Callable[[], Any], *, first: bool = False
    ) -> None:
        await every(quiet, what, action, first=first)

    vars(wiring).update(LoopLag=functools.partial(LoopLag, interval=quiet), _every=stretched)


def _variant(name: str, scratch: Path) -> dict[str, Any]:
    """hotpath.application's arguments for a variant."""
    chosen = _variant_choice(name, scratch)
    chosen["extra_env"] = {**QUIET_TIMERS, **chosen.get("extra_env", {})}
    return chosen


def _variant_choice(name: str, scratch: Path) -> dict[str, Any]:
    if name == "metrics-off":
        return {"extra_env": {"CRYPTD_METRICS": "false"}}
    if name == "metrics-multiprocess":
        from service.metrics.multiproc import init_multiprocess_dir

        directory = scratch / "metrics"
        directory.mkdir()
        init_multiprocess_dir(directory)
        return {"extra_env": {"PROMETHEUS_MULTIPROC_DIR": str(directory)}}
    if name == "replay-memory":
        return {"memory_replay": True}
    if name == "replay-redis":
        return {"redis_url": REDIS_URL}
    if name == "audit-off":
        return {"audit": False}
    return {}


async def _windows(dev_dir: Path, names: Sequence[str], variant: str) -> None:
    """Under callgrind: for each operation, the marks around a LOW and a HIGH window."""
    _quiet_clock()
    with (
        tempfile.TemporaryDirectory(prefix="cryptd-variant-") as scratch,
        application(dev_dir=dev_dir, **_variant(variant, Path(scratch))) as (app, credential),
    ):
        async with app.router.lifespan_context(app):
            for name in names:
                driver = _Driver(app, credential, name)
                warmup, low_count, high_count = driver.op.windows()
                await driver.prepare()
                driver.statuses.clear()
                await driver.drive(driver.sign(warmup))
                if driver.statuses != {200: warmup}:
                    raise RuntimeError(f"{name}: statuses {driver.statuses}")
                low, high = driver.sign(low_count), driver.sign(high_count)
                await asyncio.sleep(0.03)  # the loop-lag timer catches up after signing
                driver.statuses.clear()
                await _settle()
                _mark()
                await driver.drive(low)
                await _settle()
                _mark()
                await driver.drive(high)
                await _settle()
                _mark()
                if driver.statuses != {200: low_count + high_count}:
                    raise RuntimeError(f"{name}: statuses {driver.statuses}")


_TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def valgrind() -> str | None:
    return shutil.which("valgrind")


def count(
    names: Sequence[str], *, root: Path | None = None, variant: str = "default"
) -> dict[str, float]:
    """Instructions per request of each operation in ``names`` (OPERATIONS' names, each
    optionally with "+" and a planted step of PLANTS), one callgrind run for all. ``root``: the
    source tree to measure (default: the one this module is imported from); ``variant``: one
    of VARIANTS."""
    for name in names:
        split(name)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    binary = valgrind()
    if binary is None:
        raise RuntimeError("valgrind is not installed (Debian: apt-get install valgrind)")
    tree = root or Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="cryptd-instructions-") as scratch:
        dev_dir = Path(scratch) / "dev"  # keys generated once, outside valgrind
        prepare(dev_dir)
        out = Path(scratch) / "callgrind.out"
        path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONHASHSEED": HASH_SEED, "PYTHONPATH": path}
        command = [
            binary,
            "--tool=callgrind",
            "--dump-before=getloadavg",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "loadtest.instructions",
            "--windows",
            str(dev_dir),
            "--variant",
            variant,
            *names,
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, env=env, cwd=tree
        )
        if done.returncode != 0:
            raise RuntimeError(f"callgrind run failed: {done.stderr[-3000:]}")
        # Dumps .1, .2, ... in mark order; three marks per operation, the first of each three
        # closing what came before (start-up, warm-up, signing).
        dumps = sorted(
            Path(scratch).glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1])
        )
        if len(dumps) != 3 * len(names):
            raise RuntimeError(f"{len(dumps)} callgrind dumps for {len(names)} operations")
        totals = []
        for dump in dumps:
            found = _TOTALS.search(dump.read_text())
            if found is None:
                raise RuntimeError(f"no totals in {dump.name}")
            totals.append(int(found.group(1)))
    per_request = {}
    for i, name in enumerate(names):
        _warmup, low, high = split(name)[0].windows()
        per_request[name] = (totals[3 * i + 2] - totals[3 * i + 1]) / (high - low)
    return per_request


# --------------------------------------------------------------------------------------------
# The budget


def environment() -> dict[str, str]:
    """What the counts depend on besides cryptd's code."""
    from cryptography.hazmat.backends.openssl.backend import backend

    build, built = platform.python_build()
    found = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        # Two builds of one version (a distribution's, with PGO and LTO; pyenv's, without)
        # differ by 10-20 % in instructions: the build is part of the interpreter.
        "build": f"{build}, {built}, {platform.python_compiler()}",
        "machine": platform.machine(),
        "openssl": backend.openssl_version_text(),
    }
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def interpreter(env: Mapping[str, str]) -> str:
    """The part of the environment that changes the counts beyond any tolerance: the
    interpreter binary (implementation, version, build) and the machine. Library versions
    move a few operations a little: they are reported, and checked with the tolerance."""
    return (
        f"{env.get('implementation', '?')} {env.get('python', '?')} "
        f"({env.get('build', '?')}) {env.get('machine', '?')}"
    )


@dataclass(frozen=True)
class Verdict:
    operation: str
    budget: float
    measured: float

    @property
    def change(self) -> float:
        return self.measured / self.budget - 1

    def over(self, tolerance: float) -> bool:
        return self.change > tolerance

    def describe(self) -> str:
        return (
            f"{self.operation}: {self.measured:,.0f} instructions per request against a budget "
            f"of {self.budget:,.0f} ({self.change:+.1%}, {self.measured - self.budget:+,.0f})"
        )


def budget_file(env: Mapping[str, str] | None = None) -> Path:
    """The budget of one interpreter (``env``: default, this one's). Each interpreter that
    runs the guard (a distribution's build, pyenv's) has its own file: no tolerance bridges
    two builds, and the machine CI runs on decides which one is checked there."""
    env = environment() if env is None else env
    build = hashlib.sha256(interpreter(env).encode()).hexdigest()[:8]
    name = f"{env.get('implementation', '?')}-{env.get('python', '?')}-{build}".lower()
    return BUDGET_DIR / f"instructions-{name}.json"


def recorded_interpreters() -> list[str]:
    """The interpreters a budget is committed for."""
    return sorted(
        interpreter(json.loads(path.read_text())["environment"])
        for path in BUDGET_DIR.glob("instructions-*.json")
    )


def load_budget(path: Path | None = None) -> dict[str, Any]:
    budget: dict[str, Any] = json.loads((path or budget_file()).read_text())
    return budget


def differences(recorded: Mapping[str, str], here: Mapping[str, str]) -> list[str]:
    """The environment entries that differ, as 'name: recorded -> here'."""
    names = sorted(set(recorded) | set(here))
    return [
        f"{n}: {recorded.get(n, 'absent')} -> {here.get(n, 'absent')}"
        for n in names
        if recorded.get(n) != here.get(n)
    ]


def judge(budget: Mapping[str, Any], measured: Mapping[str, float]) -> list[Verdict]:
    return [
        Verdict(name, float(budget["operations"][split(name)[0].name]["instructions"]), count)
        for name, count in measured.items()
    ]


def report(
    verdicts: Sequence[Verdict],
    tolerance: float,
    env_changes: Sequence[str],
    path: Path | None = None,
) -> str:
    over = [v for v in verdicts if v.over(tolerance)]
    lines = []
    if over:
        where = (path or budget_file()).relative_to(BUDGET_DIR.parent.parent)
        lines.append(f"over the instruction budget (tolerance +{tolerance:.0%}, {where}):")
        lines.extend(f"  {v.describe()}" for v in over)
    else:
        lines.append(f"every operation within its budget (+{tolerance:.0%})")
    lines.extend(f"  ok {v.describe()}" for v in verdicts if not v.over(tolerance))
    if env_changes:
        lines.append(
            "the budget was recorded with another environment (counts move with these): "
            + "; ".join(env_changes)
        )
    if over:
        lines.append(
            "if the extra work is wanted, re-record: python -m loadtest.hotpath --record-budget"
        )
    return "\n".join(lines)


def record(path: Path | None = None, tolerance: float = 0.04, runs: int = 2) -> dict[str, Any]:
    """Measure every operation ``runs`` times and write the budget."""
    names = [op.name for op in OPERATIONS]
    # One after the other: each run first builds its development state in this process,
    # through the environment, which two threads would share.
    rounds = [count(names) for _ in range(runs)]
    return write_budget(rounds, path, tolerance)


def write_budget(
    rounds: Sequence[Mapping[str, float]], path: Path | None = None, tolerance: float = 0.04
) -> dict[str, Any]:
    """The budget of these measurements of every operation: the largest count of each, and
    the spread between the runs (what the tolerance must cover)."""
    operations = {}
    for op in OPERATIONS:
        seen = [r[op.name] for r in rounds]
        operations[op.name] = {
            "title": op.title,
            "instructions": round(max(seen)),
            "spread": round((max(seen) - min(seen)) / min(seen), 5),
        }
    budget = {
        "about": (
            "Instructions per request of each operation (callgrind, in-process, "
            f"{HIGH} - {LOW} requests after {WARMUP} of warm-up, a quarter of that for RSA, an "
            f"eighth for the batch, {CONCURRENCY} in flight), "
            f"the largest of {len(rounds)} runs. Checked by tests/test_instruction_budget.py; "
            "re-record with python -m loadtest.hotpath --record-budget"
        ),
        "tolerance": tolerance,
        "environment": environment(),
        "operations": operations,
    }
    path = path or budget_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(budget, indent=2) + "\n")
    return budget


def check(names: Sequence[str] | None = None, path: Path | None = None) -> tuple[bool, str]:
    """(within budget, the report) for this tree."""
    budget = load_budget(path)
    chosen = list(names or budget["operations"])
    verdicts = judge(budget, count(chosen))
    tolerance = float(budget["tolerance"])
    text = report(verdicts, tolerance, differences(budget["environment"], environment()), path)
    return not any(v.over(tolerance) for v in verdicts), text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.instructions", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("operations", nargs="*", help="default: all")
    parser.add_argument("--plant", choices=sorted(PLANTS), help="a planted extra step")
    parser.add_argument("--variant", choices=VARIANTS, default="default")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--windows", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.windows:
        import uvloop

        uvloop.run(_windows(Path(args.windows), args.operations, args.variant))
        return 0
    names = args.operations or [op.name for op in OPERATIONS]
    if args.plant:
        names = [f"{name}+{args.plant}" for name in names]
    rows = count(names, variant=args.variant)
    if args.json:
        print(orjson.dumps(rows).decode())
    else:
        for name, instructions in rows.items():
            print(f"{name}: {instructions:,.0f} instructions per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
