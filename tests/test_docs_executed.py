"""The documentation, executed: every fenced block marked ``<!-- doc-test: NAME -->`` in the
documents below runs as written, in a scratch directory, against a real server, so a command
that stops working fails a test named after its document and block
(``test_documented_block[docs/MIGRATION.md:2-migrate]``).

A document's blocks run in order, as a reader types them into one terminal: shell variables
and the working directory carry from one block to the next (exported or not, as in a shell),
and each block runs under ``set -euo pipefail``, so any failing command fails it. A block
marked ``serve`` is a server the reader starts in a terminal of its own: it runs in the
background until the document is done, and the next block waits until it answers.
Documents that start no server of their own (the README's "Try it", the client's example) get
``cryptd serve --dev`` started in their scratch directory, as the README says. Blocks whose
predecessors have not run yet run them first, so any test order works.

Markers: ``<!-- doc-test: NAME [serve] -->`` on the line before the opening fence; ``sh`` and
``python`` blocks are supported.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import POSTGRES_DSN, free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Document:
    """How a document runs.

    ``dev_server``: the test starts ``cryptd serve --dev`` for it (a document with ``serve``
    blocks starts its own servers). ``server_of``: it runs in that document's directory,
    against its development server (one server less to start). ``postgres``: the site values
    a reader sets by hand (``OWNER``, ``SERVICE``, ``ROLE``: the database's URLs and the
    service's role) come from a database and a role made for the run. ``names``: the blocks
    it must keep marked, so that a removed marker cannot quietly stop a block from running.
    """

    names: tuple[str, ...]
    dev_server: bool = False
    server_of: str | None = None  # runs where that document's dev server was started
    postgres: bool = False
    programs: tuple[str, ...] = ("bash", "jq", "openssl")


DOCUMENTS: dict[str, Document] = {
    "README.md": Document(("try-it", "keys-file"), dev_server=True),
    "client/README.md": Document(("example",), server_of="README.md"),
    "docs/MIGRATION.md": Document(
        (
            "dev-server",
            "dev-variables",
            "dev-table",
            "0-client",
            "1-create",
            "1-decrypt-only",
            "2-dry-run",
            "2-migrate",
            "2-files",
            "2-again",
            "2-usage",
            "3-disable",
            "3-delete",
            "3-cancel",
            "pq-dev-table",
            "pq-1-dual-stack",
            "pq-1-migrate",
            "pq-1-check",
            "pq-1-kem",
            "pq-2-dual-sign",
            "pq-2-composite",
            "pq-3-mldsa-only",
        )
    ),
    "docs/DEPLOY.md": Document(
        (
            "node-setup",
            "node-serve",
            "node-call",
            "pg-setup",
            "pg-serve",
            "pg-call",
            "seal-migrate",
        ),
        postgres=True,
        programs=("bash", "jq", "openssl", "curl", "psql", "softhsm2-util"),
    ),
}

_MARKER = re.compile(
    r"^<!--\s*doc-test:\s*(?P<name>[a-z0-9][a-z0-9-]*)(?P<opts>(?:\s+[a-z]+)*)\s*-->$"
)
_FENCE = re.compile(r"^```(?P<lang>[a-z]+)\s*$")
_LANGS = frozenset({"sh", "python"})
_OPTIONS = frozenset({"serve"})
_BLOCK_TIMEOUT = 180
_READY_TIMEOUT = 60
_NOT_CARRIED = (
    r"^declare -[a-zA-Z]*r|^declare -[-a-zA-Z]* "
    r"(BASH[A-Z_]*|RANDOM|SRANDOM|SECONDS|LINENO|EPOCH[A-Z]*|HISTCMD|SHLVL|PIPESTATUS|_)(=|$)"
)


@dataclass(frozen=True)
class Block:
    doc: str
    name: str
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    serve: bool = False

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.name}"


def extract(doc: str, text: str) -> list[Block]:
    """The marked blocks of one document, in order. A marker not followed by a fenced block of
    a supported language, an unknown option or a name used twice is an error."""
    lines = text.splitlines()
    blocks: list[Block] = []
    for number, line in enumerate(lines):
        marker = _MARKER.match(line.strip())
        if marker is None:
            if line.lstrip().startswith("<!--") and "doc-test" in line:
                raise ValueError(f"{doc}:{number + 1}: malformed doc-test marker: {line!r}")
            continue
        options = set(marker["opts"].split())
        if not options <= _OPTIONS:
            raise ValueError(f"{doc}:{number + 1}: unknown options {sorted(options - _OPTIONS)}")
        fence = _FENCE.match(lines[number + 1]) if number + 1 < len(lines) else None
        if fence is None or fence["lang"] not in _LANGS:
            raise ValueError(f"{doc}:{number + 1}: the marker must precede a sh or python fence")
        end = next((i for i in range(number + 2, len(lines)) if lines[i].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{doc}:{number + 2}: unterminated fence")
        code = "\n".join(lines[number + 2 : end]) + "\n"
        serve = "serve" in options
        blocks.append(Block(doc, marker["name"], fence["lang"], code, number + 2, serve))
    names = [b.name for b in blocks]
    if len(set(names)) != len(names):
        raise ValueError(f"{doc}: a doc-test name is used twice: {names}")
    return blocks


def _all_blocks() -> tuple[list[Block], list[str]]:
    """Every document's blocks, and the documents whose markers are wrong (reported by a test,
    not at collection, so a typo in a document fails one test instead of the whole run)."""
    blocks: list[Block] = []
    errors: list[str] = []
    for doc in DOCUMENTS:
        try:
            blocks += extract(doc, (ROOT / doc).read_text())
        except ValueError as exc:
            errors.append(str(exc))
    return blocks, errors


BLOCKS, MARKER_ERRORS = _all_blocks()


def _base_environment(port: int) -> dict[str, str]:
    """A reader's environment: this interpreter's ``cryptd`` and ``python3`` first on PATH, no
    cryptd settings inherited from whoever runs the tests, and a free port for the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRYPTD_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["CRYPTD_PORT"] = str(port)  # every server a document starts listens here
    env.pop("PYTHONPATH", None)
    return env


@dataclass
class DocumentRun:
    """One document's scratch directory, server(s) and shell state."""

    doc: str
    directory: Path  # the reader's working directory
    logs: Path  # outside it, so the test can check what the commands leave behind
    blocks: list[Block]
    port: int = field(default_factory=free_port)
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    host: DocumentRun | None = None  # the run whose directory and server this one uses
    outcome: dict[str, bool] = field(default_factory=dict)
    started: bool = False

    def __post_init__(self) -> None:
        self.env = _base_environment(self.port)
        self.site = contextlib.ExitStack()
        self.state = self.logs / "shell-state.sh"
        self.cwd = self.logs / "shell-cwd"
        self.cwd.write_text(str(self.directory))

    # -- servers ------------------------------------------------------------------------

    def start_dev_server(self) -> None:
        """``cryptd serve --dev`` in the scratch directory, the README's first command."""
        self._background(["cryptd", "serve", "--dev"], "dev-server")

    def _background(self, command: list[str], name: str) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        with log:
            process = subprocess.Popen(
                command,
                cwd=self.cwd.read_text().strip(),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: workers stop with it
            )
        self.servers.append(process)
        self._wait_ready(process, name)

    def _wait_ready(self, process: subprocess.Popen[bytes], name: str) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"{self.doc}:{name}: the server exited:\n{self._log_tail(name)}")
            for scheme in ("http", "https"):
                with contextlib.suppress(httpx.HTTPError, OSError):
                    # Only "does it answer yet": the blocks themselves check the certificate.
                    url = f"{scheme}://127.0.0.1:{self.port}/readyz"
                    if httpx.get(url, timeout=1, verify=False).status_code == 200:  # noqa: S501
                        return
            time.sleep(0.2)
        pytest.fail(f"{self.doc}:{name}: the server did not become ready:\n{self._log_tail(name)}")

    def _log_tail(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        """Stop the document's servers and wait until every process of theirs is gone (the
        port is free again): SIGTERM to each one's process group, SIGKILL after 30 s."""
        for process in self.servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while True:
                if process.poll() is None and time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                try:
                    os.killpg(process.pid, 0)  # any process of the group left?
                except ProcessLookupError:
                    break
                if time.monotonic() > deadline + 10:
                    pytest.fail(f"{self.doc}: a server process outlived SIGKILL")
                time.sleep(0.05)
            process.wait()
        self.servers.clear()

    # -- blocks -------------------------------------------------------------------------

    def start(self) -> None:
        """Before the first block: the programs the document uses, its site values, its
        development server (or the one of the document it shares a server with)."""
        if self.host is not None:
            self.host.start()
        if self.started:
            return
        document = DOCUMENTS[self.doc]
        _require(*document.programs)  # skips (fails under CI) every block of the document
        if document.postgres:
            self.env.update(self.site.enter_context(_postgres_site()))
        self.started = True
        if document.dev_server:
            self.start_dev_server()

    def run_through(self, block: Block) -> None:
        """Run every block of the document up to ``block`` that has not run yet."""
        self.start()
        for earlier in self.blocks:
            if earlier.name in self.outcome:
                if not self.outcome[earlier.name]:
                    pytest.fail(f"an earlier block of {self.doc} failed: {earlier.id}")
            else:
                self.outcome[earlier.name] = False
                self._run(earlier, failing_block=block)
                self.outcome[earlier.name] = True
            if earlier is block:
                return

    def _run(self, block: Block, failing_block: Block) -> None:
        where = f"{block.id} (line {block.line})"
        if block is not failing_block:
            where += f", run before {failing_block.id}"
        script = self.logs / f"{block.name}.block"
        script.write_text(block.code)
        if block.serve:
            self.stop()  # the reader stops the server the document started before (Ctrl-C)
            self._background(["bash", "-c", self._shell(script, save=False)], block.name)
            return
        if block.lang == "python":
            command = [sys.executable, str(script)]
        else:
            command = ["bash", "--noprofile", "--norc", "-c", self._shell(script, save=True)]
        try:
            done = subprocess.run(
                command,
                cwd=self.cwd.read_text().strip(),
                env=self.env,
                capture_output=True,
                timeout=_BLOCK_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{where}: still running after {_BLOCK_TIMEOUT} s")
        output = (done.stdout + done.stderr).decode(errors="replace")
        (self.logs / f"{block.name}.out").write_text(output)
        assert done.returncode == 0, f"{where} failed (exit {done.returncode}):\n{output[-6000:]}"

    def _shell(self, script: Path, *, save: bool) -> str:
        """Restore the previous blocks' variables, umask and directory, run the block strictly,
        save them for the next."""
        state, cwd = _q(self.state), _q(self.cwd)
        restore = f'[ -f {state} ] && source {state} 2>/dev/null; cd "$(cat {cwd})"\n'
        run = f"set -euo pipefail\nsource {_q(script)}\n"
        if not save:  # a server, in the foreground of its own shell
            return restore + run
        keep = (
            "set +eu\n"
            # Not read-only variables, nor bash's own (RANDOM would be re-seeded, SHLVL grow).
            f"declare -p | grep -Ev '{_NOT_CARRIED}' > {_q(self.state)}.new\n"
            f'echo "umask $(umask)" >> {_q(self.state)}.new\n'
            f"mv {_q(self.state)}.new {_q(self.state)}\n"
            f"pwd > {_q(self.cwd)}\n"
        )
        return restore + run + keep


def _q(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def _require(*programs: str) -> None:
    for program in programs:
        if shutil.which(program) is None:
            message = f"the documentation uses {program}, which is not installed"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)


@contextlib.contextmanager
def _postgres_site() -> Iterator[dict[str, str]]:
    """A database and a login role of their own on the local PostgreSQL, as the site values
    (OWNER, SERVICE, ROLE) a reader writes for their database; both dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    try:
        admin = psycopg.connect(POSTGRES_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required under CI: {exc}")
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is not reachable: {exc}")
    name = f"cryptd_doc_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE ROLE "{name}" LOGIN')
        try:
            admin.execute(f'CREATE DATABASE "{name}"')
            try:
                yield {
                    "OWNER": f"postgresql://postgres@127.0.0.1:5432/{name}",
                    "SERVICE": f"postgresql://{name}@127.0.0.1:5432/{name}",
                    "ROLE": name,
                }
            finally:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            admin.execute(f'DROP ROLE IF EXISTS "{name}"')


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DocumentRun]]:
    runs: dict[str, DocumentRun] = {}
    for doc in DOCUMENTS:
        base = tmp_path_factory.mktemp(doc.replace("/", "-").replace(".", "-"))
        (base / "work").mkdir()
        (base / "logs").mkdir()
        blocks = [b for b in BLOCKS if b.doc == doc]
        shared = DOCUMENTS[doc].server_of
        if shared is None:
            runs[doc] = DocumentRun(doc, base / "work", base / "logs", blocks)
        else:
            host = runs[shared]
            runs[doc] = DocumentRun(doc, host.directory, base / "logs", blocks, host.port)
            runs[doc].host = host
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()
            run.site.close()


def test_every_document_keeps_its_blocks_marked() -> None:
    assert MARKER_ERRORS == []
    found: dict[str, tuple[str, ...]] = {}
    for block in BLOCKS:
        found[block.doc] = (*found.get(block.doc, ()), block.name)
    assert found == {doc: document.names for doc, document in DOCUMENTS.items()}


def test_markers_are_checked() -> None:
    text = "<!-- doc-test: a -->\n```sh\necho a\n```\n<!-- doc-test: b serve -->\n```sh\nx\n```\n"
    blocks = extract("x.md", text)
    assert [(b.name, b.serve, b.code, b.line) for b in blocks] == [
        ("a", False, "echo a\n", 2),
        ("b", True, "x\n", 6),
    ]
    for bad in (
        "<!-- doc-test: a -->\n\n```sh\necho\n```\n",  # not right before the fence
        "<!-- doc-test: a -->\n```text\necho\n```\n",  # not a language that runs
        "<!-- doc-test: a later -->\n```sh\necho\n```\n",  # unknown option
        "<!-- doc-test: a -->\n```sh\necho\n",  # unterminated
        "<!-- doc-test: a -->\n```sh\n```\n<!-- doc-test: a -->\n```sh\n```\n",  # twice
        "<!-- doc-test a -->\n```sh\n```\n",  # malformed
    ):
        with pytest.raises(ValueError, match=r"x\.md"):
            extract("x.md", bad)


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_documented_block(block: Block, documents: dict[str, DocumentRun]) -> None:
    run = documents[block.doc]
    run.run_through(block)
    if block.id == "docs/DEPLOY.md:pg-call":
        # The token made while the keys were in the file decrypts with them in PostgreSQL.
        output = (run.logs / "pg-call.out").read_text().splitlines()
        assert output == ["hello world", '"postgresql"']
        # Keys, secrets and the database URL: readable by the service's user alone.
        node = run.directory / "cryptd-node"
        exposed = [f.name for f in node.iterdir() if f.stat().st_mode & 0o077]
        assert exposed == []
    if block.id == "docs/DEPLOY.md:seal-migrate":
        # Moved to the token, the key store opens as it was; the plain key file is gone.
        output = (run.logs / "seal-migrate.out").read_text().splitlines()
        assert [line for line in output if line in ("pkcs11", "1")] == ["pkcs11", "1"]
        assert any("is now kept by the pkcs11 seal" in line for line in output)
        assert not (run.directory / "seal-demo" / "master.key").exists()
    if block.id == "docs/MIGRATION.md:2-again":
        # The restored row, and only it, is migrated by the second pass.
        report = (run.logs / "2-again.out").read_text()
        assert "pass        2:" in report
        assert "migrated    1\n" in report
        assert "already_under_target 223" in report
    if block.id == "docs/MIGRATION.md:pq-1-migrate":
        # Every RSA-wrapped data key is now under X-Wing, a sample of them checked.
        report = (run.logs / "pq-1-migrate.out").read_text()
        assert "migrated    200\n" in report
        assert "failed      0" in report
    if block.id == "docs/MIGRATION.md:pq-2-dual-sign":
        signed = (run.logs / "pq-2-dual-sign.out").read_text()
        assert signed.count('"valid": true') == 2
        assert "another context: not valid, as it should be" in signed
    if block.id == "docs/MIGRATION.md:pq-3-mldsa-only":
        lines = [
            line.strip() for line in (run.logs / "pq-3-mldsa-only.out").read_text().splitlines()
        ]
        assert "refused, as it should be" in lines
        assert "3309" in lines  # the ML-DSA-65 signature's bytes
    if block.id == "README.md:try-it":
        # Key material and backups go to a temporary directory, which the block removes.
        assert sorted(p.name for p in run.directory.iterdir()) == [".cryptd-dev"]
