"""The container image, checked without a Docker engine: the Dockerfile (hadolint and a point by
point review), .dockerignore, the pinned dependency set, and the entrypoint, healthcheck and
libcrypto scripts run directly on this machine, as the image would run them."""

from __future__ import annotations

import fnmatch
import http.server
import importlib.util
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.test_k8s_support import (
    K8S,
    ROOT,
    free_port,
    load_docs,
    tool,
    world_tempdir,
    write_executable,
)

DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
SHELL_SCRIPTS = [
    ENTRYPOINT,
    ROOT / "docker" / "debian-base.sh",
    ROOT / ".ci" / "build-image",
    *sorted((K8S / "scripts").glob("*.sh")),
]
NOBODY = 65534
EX_CONFIG = 78


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- Dockerfile --------------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        result.append((keyword.upper(), args.strip()))
    return result


def stages(text: str) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, args in instructions(text):
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, args))
    return found


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in stage:
        if keyword == "ENV":
            for name, value in re.findall(r"(\w+)=(\S+)", args):
                env[name] = value
    return env


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def runtime(dockerfile: str) -> list[tuple[str, str]]:
    return stages(dockerfile)[-1]


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_flags_a_careless_dockerfile(tmp_path: Path) -> None:
    # The linter is live: the faults the real Dockerfile avoids are reported.
    careless = tmp_path / "Dockerfile"
    careless.write_text(
        "FROM python:latest\nRUN apt-get update && apt-get install -y curl\n"
        "ADD . /app\nENTRYPOINT cryptd serve\n"
    )
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(careless)], capture_output=True, text=True
    )
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3020", "DL3025"):
        assert rule in result.stdout


def test_multi_stage_with_the_same_base_pinned_by_tag_and_digest(dockerfile: str) -> None:
    found = stages(dockerfile)
    assert len(found) >= 2
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert base is not None
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base.group(1))
    for stage in found:
        assert stage[0][1].startswith("${PYTHON_IMAGE}")
    assert "AS build" in found[0][0][1]


def test_wheels_are_built_in_the_first_stage_and_installed_offline(dockerfile: str) -> None:
    build, *_, runtime = stages(dockerfile)
    build_runs = " ".join(args for keyword, args in build if keyword == "RUN")
    assert "pip wheel" in build_runs
    assert "--only-binary=:all:" in build_runs
    assert "--constraint docker/constraints.txt" in build_runs
    runtime_runs = " ".join(args for keyword, args in runtime if keyword == "RUN")
    assert "from=build" in runtime_runs
    assert "--no-index" in runtime_runs
    assert re.search(r"pip uninstall --yes( --\S+)* pip setuptools wheel", runtime_runs)
    assert not any(keyword == "ADD" for keyword, _ in runtime)


def test_the_image_installs_the_extras_its_constraints_pin(dockerfile: str) -> None:
    # docker/update_constraints.py pins the closure of IMAGE_EXTRAS: the Dockerfile builds and
    # installs exactly those extras (postgresql: the k8s/postgresql key store).
    lock = _module(ROOT / "docker" / "update_constraints.py")
    assert "postgresql" in lock.IMAGE_EXTRAS
    extras = "[" + ",".join(lock.IMAGE_EXTRAS) + "]"
    build, *_, runtime = stages(dockerfile)
    wheel_step = next(args for keyword, args in build if keyword == "RUN" and "pip wheel" in args)
    assert f"--constraint docker/constraints.txt '.{extras}'" in wheel_step
    install_step = next(a for k, a in runtime if k == "RUN" and "pip install" in a)
    assert f'"$(ls /wheels/cryptd-*.whl){extras}"' in install_step


def test_downloads_happen_in_the_build_stage_only(dockerfile: str) -> None:
    # The build secret (a CA bundle) and pip's cache are mounted for the wheel step only; the
    # runtime stage mounts nothing but the build stage's wheels.
    build, *_, runtime = stages(dockerfile)
    wheel_step = next(args for keyword, args in build if keyword == "RUN" and "pip wheel" in args)
    assert "--mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt," in (
        wheel_step
    )
    assert "required=false" in wheel_step
    assert "--mount=type=cache,target=/root/.cache/pip" in wheel_step
    mounts = re.findall(r"--mount=(\S+)", " ".join(a for k, a in runtime if k == "RUN"))
    assert mounts == ["type=bind,from=build,source=/wheels,target=/wheels"]
    assert "--no-cache-dir" in " ".join(a for k, a in runtime if k == "RUN")


def test_runtime_runs_as_a_numeric_non_root_user_matching_the_deployment(
    runtime: list[tuple[str, str]],
) -> None:
    users = [args for keyword, args in runtime if keyword == "USER"]
    assert users, "no USER in the runtime stage"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit()
    assert int(uid) != 0
    assert gid.isdigit()
    assert int(gid) != 0
    deployment = next(
        doc for doc in load_docs(K8S / "base" / "deployment.yaml") if doc["kind"] == "Deployment"
    )
    pod = deployment["spec"]["template"]["spec"]["securityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"]) == (int(uid), int(gid))


def test_healthcheck_stopsignal_and_exec_form_entrypoint(runtime: list[tuple[str, str]]) -> None:
    by_keyword = dict(runtime)
    assert by_keyword["STOPSIGNAL"] == "SIGTERM"
    health = by_keyword["HEALTHCHECK"]
    exec_form = health.split(" CMD ", 1)[1]
    command = json.loads(exec_form)
    assert command[0] == "python"
    assert command[-1].endswith("healthcheck.py")
    entrypoint = json.loads(by_keyword["ENTRYPOINT"])
    assert isinstance(entrypoint, list)
    assert entrypoint == ["/usr/local/bin/cryptd-entrypoint"]
    assert json.loads(by_keyword["CMD"]) == []
    copies = [args for keyword, args in runtime if keyword == "COPY"]
    assert any("docker/entrypoint.sh /usr/local/bin/cryptd-entrypoint" in c for c in copies)
    assert by_keyword["EXPOSE"] == "8080"


def test_runtime_environment_is_read_only_friendly(runtime: list[tuple[str, str]]) -> None:
    env = env_of(runtime)
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["CRYPTD_KEYRING_READ_ONLY"] == "true"
    assert env["TMPDIR"] == "/tmp"
    assert env["PROMETHEUS_MULTIPROC_DIR"].startswith("/run/")


def test_image_defaults_agree_with_the_kubernetes_config(runtime: list[tuple[str, str]]) -> None:
    env = env_of(runtime)
    kustomization = load_docs(K8S / "base" / "kustomization.yaml")[0]
    literals = dict(
        item.split("=", 1)
        for generator in kustomization["configMapGenerator"]
        if generator["name"] == "cryptd-config"
        for item in generator["literals"]
    )
    shared = set(env) & set(literals)
    assert {"CRYPTD_MASTER_KEY_FILE", "CRYPTD_KEYRING_FILE", "CRYPTD_CLIENTS_FILE"} <= shared
    assert {name: env[name] for name in shared} == {name: literals[name] for name in shared}


# --- .dockerignore -----------------------------------------------------------------------------


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent directory
    matches everything below it."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        regex = fnmatch.translate(body).replace(".*", "[^/]*")
        if body.startswith("**/"):
            regex = "(.*/)?" + fnmatch.translate(body[3:]).replace(".*", "[^/]*")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negate
    return excluded


@pytest.fixture(scope="module")
def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_every_copied_file_is_in_the_build_context(
    dockerfile: str, ignore_patterns: list[str]
) -> None:
    sources: list[str] = []
    for keyword, args in instructions(dockerfile):
        if keyword == "COPY" and "--from" not in args:
            words = [word for word in args.split() if not word.startswith("--")]
            sources.extend(words[:-1])
    assert "docker/entrypoint.sh" in sources
    for source in sources:
        if source == "README.md" and not (ROOT / source).exists():
            continue  # the project README is written alongside; the build needs it
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(ignore_patterns, source.rstrip("/")), source
    assert not dockerignore_excludes(ignore_patterns, "service/api/application.py")


@pytest.mark.parametrize(
    "path",
    [
        ".git/config",
        ".venv/bin/python",
        "tests/test_container.py",
        "k8s/base/deployment.yaml",
        ".cryptd-dev/master.key",
        "keyring.json",
        "service/__pycache__/app.cpython-311.pyc",
        "docker/update_constraints.py",
        "docker/debian-base.sh",
        "loadtest/results/run.json",
    ],
)
def test_dockerignore_keeps_secrets_and_clutter_out(ignore_patterns: list[str], path: str) -> None:
    assert dockerignore_excludes(ignore_patterns, path)


# --- pinned runtime dependencies ----------------------------------------------------------------


def test_constraints_pin_every_runtime_dependency() -> None:
    lock = _module(ROOT / "docker" / "update_constraints.py")
    pinned = lock.read_constraints()
    closure = lock.runtime_closure()
    missing = sorted(set(closure) - set(pinned))
    assert not missing, f"run: python docker/update_constraints.py (missing {missing})"
    for name, version in pinned.items():
        assert re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version), (name, version)


# --- scripts run directly -------------------------------------------------------------------------


def test_libcrypto_check_accepts_this_machines_openssl() -> None:
    # Debian bookworm here, like the image's base: OpenSSL 3.0 with SM2.
    result = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "check_libcrypto.py")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "SM2" in result.stdout


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_Health]]]:
    handler = type("Handler", (_Health,), {"status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def _run_healthcheck(
    port: int, host: str = "0.0.0.0", **settings: str
) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "CRYPTD_HOST": host, "CRYPTD_PORT": str(port), **settings}
    script = ROOT / "docker" / "healthcheck.py"
    return subprocess.run(
        [sys.executable, str(script)], env=env, check=False, capture_output=True, text=True
    )


def _healthcheck(port: int, host: str = "0.0.0.0", **settings: str) -> int:
    return _run_healthcheck(port, host, **settings).returncode


@pytest.mark.slow
def test_healthcheck_follows_healthz(health_server: tuple[int, type[_Health]]) -> None:
    port, handler = health_server
    assert _healthcheck(port) == 0
    assert _healthcheck(port, host="127.0.0.1") == 0
    handler.status = 503
    assert _healthcheck(port) == 1
    assert _healthcheck(free_port()) == 1  # nothing listening


@pytest.fixture
def tls_health_server(tmp_path: Path) -> Iterator[tuple[int, type[_Health], Path]]:
    """The health server over TLS, with a certificate from a private CA (as cert-manager's
    names the Service, not the loopback address); yields its port, handler and cert file."""
    from service.edge.devcerts import issue, make_ca

    ca = make_ca("healthcheck test CA")
    leaf = issue(ca, ["cryptd.cryptd.svc"])
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(leaf.cert_pem())
    key.write_bytes(leaf.key_pem())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    handler = type("Handler", (_Health,), {"status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    # A failed handshake (plain HTTP sent to this port) is the client's problem, not a
    # traceback on the test's stderr.
    server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler, cert
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_healthcheck_speaks_https_when_the_server_does(
    tls_health_server: tuple[int, type[_Health], Path],
    health_server: tuple[int, type[_Health]],
) -> None:
    port, handler, cert = tls_health_server
    tls = {"CRYPTD_TLS_CERT_FILE": str(cert), "CRYPTD_TLS_KEY_FILE": str(cert.with_suffix(".key"))}
    assert _healthcheck(port, **tls) == 0
    assert _healthcheck(port, host="127.0.0.1", **tls) == 0
    handler.status = 503
    failed = _run_healthcheck(port, **tls)
    assert failed.returncode == 1
    # Why, in one line (an engine keeps it in the container's health log).
    assert failed.stderr == f"healthcheck: https://127.0.0.1:{port}/healthz: HTTP 503\n"
    handler.status = 200
    # Plain HTTP to the TLS port gets no answer.
    assert _healthcheck(port) == 1
    # A plain server where TLS is configured does not pass for healthy; CRYPTD_TLS=off (a
    # proxy terminates TLS in front) probes it over HTTP.
    plain_port, _ = health_server
    assert _healthcheck(plain_port, **tls) == 1
    assert _healthcheck(plain_port, CRYPTD_TLS="off") == 0
    nothing = _run_healthcheck(free_port(), **tls)
    assert nothing.returncode == 1
    assert "ConnectionRefusedError" in nothing.stderr
    assert len(nothing.stderr.splitlines()) == 1


def test_healthcheck_probes_loopback_for_wildcard_binds() -> None:
    health = _module(ROOT / "docker" / "healthcheck.py")
    assert health.probe_target({"CRYPTD_HOST": "0.0.0.0", "CRYPTD_PORT": "9000"}) == (
        "127.0.0.1",
        9000,
    )
    assert health.probe_target({}) == ("127.0.0.1", 8080)
    assert health.probe_target({"CRYPTD_HOST": "10.1.2.3"}) == ("10.1.2.3", 8080)


@pytest.mark.slow
def test_shell_scripts_pass_shellcheck() -> None:
    result = subprocess.run(
        [tool("shellcheck"), "--shell=bash", *map(str, SHELL_SCRIPTS)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


# --- the entrypoint ----------------------------------------------------------------------------

# Stands in for the server: reports its PID and its arguments, NUL-separated.
FAKE_CRYPTD = '#!/bin/bash\nprintf \'%s\\0\' "$$" "$@"\n'


class Sandbox:
    """The container's filesystem, emulated: Secrets mounted the kubelet's way (symlinks into
    a ..data directory), writable emptyDirs for /tmp and the metrics directory, and a
    read-only working directory and home. A fake `cryptd` comes first on PATH."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.work = root / "work"
        self.home = root / "home"
        self.tmp = root / "tmp"
        self.metrics = root / "metrics"
        for directory in (self.bin, self.work, self.home, self.tmp, self.metrics):
            directory.mkdir()
        write_executable(self.bin / "cryptd", FAKE_CRYPTD)
        self.files = {
            "CRYPTD_MASTER_KEY_FILE": self._secret("master-key", "master.key", "a2V5\n"),
            "CRYPTD_KEYRING_FILE": self._secret("keyring", "keyring.json", '{"keys": {}}'),
            "CRYPTD_CLIENTS_FILE": self._secret("clients", "clients.json", '{"clients": {}}'),
        }
        self.as_nobody = os.geteuid() == 0
        if self.as_nobody:
            for directory in (self.tmp, self.metrics):
                os.chown(directory, NOBODY, NOBODY)
        for directory in (self.work, self.home):
            directory.chmod(0o555)

    def _secret(self, volume: str, name: str, content: str) -> Path:
        mount = self.root / "secrets" / volume
        data = mount / "..2026_01_01_00_00_00.000000001"
        data.mkdir(parents=True)
        (data / name).write_text(content)
        (data / name).chmod(0o444)
        (mount / "..data").symlink_to(data.name)
        (mount / name).symlink_to(f"..data/{name}")
        return mount / name

    def env(self, **overrides: str) -> dict[str, str]:
        env = {
            "PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "TMPDIR": str(self.tmp),
            "PROMETHEUS_MULTIPROC_DIR": str(self.metrics),
            "CRYPTD_ENV": "production",
            **{name: str(path) for name, path in self.files.items()},
        }
        env.update(overrides)
        return {name: value for name, value in env.items() if value != ""}

    def command(self, *args: str) -> list[str]:
        prefix: list[str] = []
        if self.as_nobody:
            prefix = [
                tool("setpriv"),
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
            ]
        return [*prefix, "/bin/bash", str(ENTRYPOINT), *args]

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            self.command(*args),
            cwd=self.work,
            env=self.env(**env),
            capture_output=True,
            timeout=30,
            check=False,
        )

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """Every path outside the metrics directory, with its mode, size and mtime."""
        state: dict[str, tuple[int, int, int]] = {}
        for path in sorted(self.root.rglob("*")):
            if path == self.metrics or self.metrics in path.parents:
                continue
            st = path.lstat()
            state[str(path.relative_to(self.root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
        return state


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    with world_tempdir() as root:
        yield Sandbox(root)


def _forwarded(result: subprocess.CompletedProcess[bytes]) -> list[str]:
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode().split("\0")[:-1]


def test_entrypoint_execs_cryptd_serve_with_the_arguments(sandbox: Sandbox) -> None:
    stale = sandbox.metrics / "counter_1234.db"
    stale.write_bytes(b"\0" * 64)
    unrelated = sandbox.metrics / "README"
    unrelated.write_text("not a metrics file")
    if sandbox.as_nobody:
        os.chown(stale, NOBODY, NOBODY)
    before = sandbox.snapshot()

    process = subprocess.Popen(
        sandbox.command("--workers", "3", "--log-level", "debug"),
        cwd=sandbox.work,
        env=sandbox.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err.decode()
    pid, *argv = out.decode().split("\0")[:-1]
    assert argv == ["serve", "--workers", "3", "--log-level", "debug"]
    # exec: the server is the process that was started (setpriv execs too), so it gets SIGTERM.
    assert int(pid) == process.pid
    assert not stale.exists(), "stale metrics file left behind"
    assert unrelated.exists(), "only *.db metrics files are removed"
    assert sandbox.snapshot() == before, "the entrypoint wrote outside PROMETHEUS_MULTIPROC_DIR"
    assert err == b""


def test_entrypoint_forwards_sigterm_to_the_server(sandbox: Sandbox) -> None:
    write_executable(
        sandbox.bin / "cryptd",
        "#!/bin/bash\ntrap 'echo drained; exit 0' TERM\necho ready\n"
        "for _ in $(seq 600); do sleep 0.05; done\nexit 3\n",
    )
    process = subprocess.Popen(
        sandbox.command(),
        cwd=sandbox.work,
        env=sandbox.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert out.strip() == "drained"


@pytest.mark.parametrize(
    "variable", ["CRYPTD_MASTER_KEY_FILE", "CRYPTD_KEYRING_FILE", "CRYPTD_CLIENTS_FILE"]
)
def test_entrypoint_refuses_a_missing_secret_file(sandbox: Sandbox, variable: str) -> None:
    missing = sandbox.root / "secrets" / "absent" / "file"
    result = sandbox.run(**{variable: str(missing)})
    assert result.returncode == EX_CONFIG
    assert result.stdout == b"", "cryptd must not start"
    message = result.stderr.decode()
    assert f"{variable}={missing} does not exist" in message
    assert message.startswith("cryptd-entrypoint: error:")


@pytest.mark.parametrize(
    "variable", ["CRYPTD_TLS_CERT_FILE", "CRYPTD_TLS_KEY_FILE", "CRYPTD_TLS_CLIENT_CA_FILE"]
)
def test_entrypoint_checks_the_tls_files_it_is_given(sandbox: Sandbox, variable: str) -> None:
    mount = sandbox.root / "secrets" / "tls"
    files = {
        "CRYPTD_TLS_CERT_FILE": "tls.crt",
        "CRYPTD_TLS_KEY_FILE": "tls.key",
        "CRYPTD_TLS_CLIENT_CA_FILE": "ca.crt",
    }
    data = mount / "..2026_01_01_00_00_00.000000001"
    data.mkdir(parents=True)
    (mount / "..data").symlink_to(data.name)
    for name in files.values():
        (data / name).write_text("-----BEGIN CERTIFICATE-----\n")
        (data / name).chmod(0o444)
        (mount / name).symlink_to(f"..data/{name}")
    settings = {v: str(mount / name) for v, name in files.items()}
    assert _forwarded(sandbox.run(**settings))[1:] == ["serve"]
    # Not mounted (cert-manager has not issued it yet), or empty: named, never started.
    missing = sandbox.root / "secrets" / "absent" / files[variable]
    result = sandbox.run(**{**settings, variable: str(missing)})
    assert result.returncode == EX_CONFIG
    assert result.stdout == b"", "cryptd must not start"
    assert f"{variable}={missing} does not exist (is the Secret mounted?)" in result.stderr.decode()
    (data / files[variable]).chmod(0o644)
    (data / files[variable]).write_text("")
    result = sandbox.run(**settings)
    assert result.returncode == EX_CONFIG
    assert f"{variable}={mount / files[variable]} is empty" in result.stderr.decode()


def test_entrypoint_refuses_an_unset_master_key(sandbox: Sandbox) -> None:
    result = sandbox.run(CRYPTD_MASTER_KEY_FILE="")
    assert result.returncode == EX_CONFIG
    assert b"CRYPTD_MASTER_KEY_FILE is not set" in result.stderr


def test_entrypoint_refuses_an_empty_keyring(sandbox: Sandbox) -> None:
    empty = sandbox.root / "empty.json"
    empty.touch()
    empty.chmod(0o444)
    result = sandbox.run(CRYPTD_KEYRING_FILE=str(empty))
    assert result.returncode == EX_CONFIG
    assert b"is empty" in result.stderr


def test_entrypoint_never_prints_secret_content(sandbox: Sandbox) -> None:
    bad = sandbox.root / "not-a-file"
    bad.mkdir()
    result = sandbox.run(CRYPTD_MASTER_KEY_FILE=str(bad))
    assert result.returncode == EX_CONFIG
    assert b"not a regular file" in result.stderr
    assert b"a2V5" not in result.stderr + result.stdout


def test_entrypoint_refuses_a_read_only_metrics_dir(sandbox: Sandbox) -> None:
    read_only = sandbox.root / "ro-metrics"
    read_only.mkdir(mode=0o555)
    read_only.chmod(0o555)
    if not sandbox.as_nobody and os.geteuid() == 0:
        pytest.skip("root ignores directory modes")
    result = sandbox.run(PROMETHEUS_MULTIPROC_DIR=str(read_only))
    assert result.returncode == EX_CONFIG
    assert b"PROMETHEUS_MULTIPROC_DIR=" in result.stderr
    assert b"not writable" in result.stderr


def test_entrypoint_needs_the_metrics_dir_unless_metrics_are_off(sandbox: Sandbox) -> None:
    result = sandbox.run(PROMETHEUS_MULTIPROC_DIR="")
    assert result.returncode == EX_CONFIG
    assert b"PROMETHEUS_MULTIPROC_DIR is not set" in result.stderr
    metrics_off = sandbox.run(PROMETHEUS_MULTIPROC_DIR="", CRYPTD_METRICS="false")
    assert _forwarded(metrics_off)[1:] == ["serve"]


def test_entrypoint_refuses_an_unreadable_secret(sandbox: Sandbox) -> None:
    if not sandbox.as_nobody:
        pytest.skip("needs root to run the entrypoint as another user")
    target = sandbox.files["CRYPTD_CLIENTS_FILE"].resolve()
    target.chmod(0o400)  # root's only: as in a pod without the fsGroup
    result = sandbox.run()
    assert result.returncode == EX_CONFIG
    assert b"not readable by uid 65534" in result.stderr


def test_entrypoint_passes_admin_commands_through_unchecked(sandbox: Sandbox) -> None:
    result = sandbox.run("keys", "list", CRYPTD_MASTER_KEY_FILE="", CRYPTD_KEYRING_FILE="")
    argv = _forwarded(result)
    assert argv[1:] == ["keys", "list"]
    assert _forwarded(sandbox.run("master-key", "generate"))[1:] == ["master-key", "generate"]


def test_entrypoint_development_mode_skips_the_secret_checks(sandbox: Sandbox) -> None:
    result = sandbox.run(
        "--dev",
        CRYPTD_ENV="development",
        CRYPTD_MASTER_KEY_FILE="",
        CRYPTD_KEYRING_FILE="",
        CRYPTD_CLIENTS_FILE="",
    )
    assert _forwarded(result)[1:] == ["serve", "--dev"]


def test_entrypoint_accepts_a_master_key_from_the_environment(sandbox: Sandbox) -> None:
    result = sandbox.run(CRYPTD_MASTER_KEY_FILE="", CRYPTD_MASTER_KEY="c2VjcmV0")
    assert _forwarded(result)[1:] == ["serve"]
    assert b"c2VjcmV0" not in result.stderr  # the value is never echoed
    assert b"a mounted file (CRYPTD_MASTER_KEY_FILE) is preferred" in result.stderr
