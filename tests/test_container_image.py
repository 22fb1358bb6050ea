"""The built container image, run the way Kubernetes runs it (k8s/base/deployment.yaml).

`.ci/build-image DIR` builds the Dockerfile with buildah and exports the image's root filesystem
and configuration; CRYPTD_IMAGE_DIR names that directory. No container engine runs here, so
this module does an engine's work itself, from the image's own configuration and the
Deployment: private mount, PID, IPC and UTS namespaces; the image's root filesystem mounted
read-only; the Deployment's Secrets mounted read-only the way the kubelet lays them out, its
emptyDirs as size-limited tmpfs, /dev, /dev/shm and /proc as an engine provides them; the
image's user with every capability dropped and no_new_privs; the image's entrypoint and
environment plus the ConfigMap's settings. The host's network is shared, so the port is a free
one and the address loopback; nothing else is overridden.

The server serves HTTPS only, as in production: the test makes a private CA and a server
certificate for the Certificate's names (and the loopback address the test reaches it on) and
provides them as the Secret cert-manager would write (cryptd-tls: tls.crt, tls.key, ca.crt).
Then: signed requests over HTTPS, verified against that CA, through the project's client
(AES-GCM, SM2 through the image's libcrypto, RSA on the process pool); nothing in clear text
on the port; the image's HEALTHCHECK command and the Deployment's preStop command executed
inside the container as the image's user; SIGTERM to PID 1 with a request in flight: the
request is answered and the container exits 0. And the PostgreSQL deployment
(k8s/postgresql): the image's psycopg serving and managing keys in a database of the test's
own on the real PostgreSQL.

Without CRYPTD_IMAGE_DIR the module skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from cryptd_client import ConflictError, CryptdClient
from service.edge.devcerts import Issued, issue, make_ca
from tests.test_k8s_support import (
    IN_CI,
    K8S,
    ROOT,
    cryptd_shim,
    free_port,
    load_docs,
    publish_secret,
    require_cli,
    tool,
    world_tempdir,
)

pytestmark = pytest.mark.slow

LAUNCH = Path(__file__).with_name("container_launch.py")
GRACE_SECONDS = 40  # terminationGracePeriodSeconds (45) less the preStop hook (5)
LONG_BATCH = 500  # RSA-4096 signatures in the request that is in flight at SIGTERM


# --- the image and the Deployment ----------------------------------------------------------------


@dataclass(frozen=True)
class KeyStore:
    """The PostgreSQL key store of the k8s/postgresql deployment: the URL the pod uses (from
    the Secret cryptd-keystore), the one the test copies the keyring in with (the same, but for
    host paths), and the CA the pod trusts for the database (Secret cryptd-keystore-ca)."""

    url: str
    copy_url: str
    ca: bytes | None = None


@dataclass(frozen=True)
class Image:
    rootfs: Path
    document: dict[str, Any]  # the image configuration (docker format, as built)

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.document["config"]
        return config

    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config.get("Env") or [])

    def user(self) -> tuple[int, int]:
        uid, _, gid = self.config["User"].partition(":")
        return int(uid), int(gid)

    def path(self, inside: str) -> Path:
        return self.rootfs / inside.lstrip("/")


@pytest.fixture(scope="module")
def image() -> Image:
    directory = os.environ.get("CRYPTD_IMAGE_DIR", "")
    problem = ""
    if not directory:
        problem = "CRYPTD_IMAGE_DIR is not set: build the image with .ci/build-image DIR"
    elif not (Path(directory) / "image.json").is_file():
        problem = f"CRYPTD_IMAGE_DIR={directory} holds no exported image (.ci/build-image DIR)"
    elif os.geteuid() != 0:
        problem = "running the image needs root (mount and PID namespaces, chroot)"
    if problem:
        if IN_CI:
            pytest.fail(problem)
        pytest.skip(problem)
    path = Path(directory)
    return Image(path / "rootfs", json.loads((path / "image.json").read_text()))


@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    deployment = next(
        doc for doc in load_docs(K8S / "base" / "deployment.yaml") if doc["kind"] == "Deployment"
    )
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def _container_spec(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = next(c for c in pod["containers"] if c["name"] == "cryptd")
    return container


def _config_map(name: str) -> dict[str, str]:
    kustomization = load_docs(K8S / "base" / "kustomization.yaml")[0]
    generator = next(g for g in kustomization["configMapGenerator"] if g["name"] == name)
    return dict(item.split("=", 1) for item in generator.get("literals", []))


def _base_config_maps() -> dict[str, dict[str, str]]:
    return {"cryptd-config": _config_map("cryptd-config")}


def _server_certificate() -> dict[str, Any]:
    """The cert-manager Certificate that writes the server's TLS Secret."""
    certificate: dict[str, Any] = next(
        doc
        for doc in load_docs(K8S / "base" / "certificate.yaml")
        if doc["kind"] == "Certificate" and not doc["spec"].get("isCA")
    )
    return certificate


def _size(quantity: str) -> str:
    """A Kubernetes quantity (64Mi) as a tmpfs size option (64m)."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity)
    assert match, f"size limit {quantity!r} not understood"
    return match.group(1) + match.group(2)[0].lower()


# --- a container, run as the Deployment describes it -------------------------------------------


@dataclass
class Container:
    """One run of the image: secrets on the host, the namespaces, PID 1 and its log."""

    image: Image
    pod: dict[str, Any]
    secrets: dict[str, dict[str, bytes]]
    work: Path
    # envFrom's ConfigMaps by name (the base's generator, or a kustomize output's, hashed names)
    config_maps: dict[str, dict[str, str]] = field(default_factory=_base_config_maps)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    generations: dict[str, int] = field(default_factory=dict)  # of Secrets updated since start

    @property
    def spec(self) -> dict[str, Any]:
        return _container_spec(self.pod)

    @property
    def scheme(self) -> str:
        """The scheme the Deployment's probes use: HTTPS, unless the pod serves plain HTTP."""
        probe = self.spec["readinessProbe"]["httpGet"]
        return str(probe.get("scheme", "HTTP")).lower()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        """The CA of the server's certificate, on the host: the mounted TLS Secret's ca.crt."""
        secret: str = _server_certificate()["spec"]["secretName"]
        return self.work / "secrets" / secret / "ca.crt"

    def verify(self) -> ssl.SSLContext:
        """A client context trusting only the server's CA (hostname checked)."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    @property
    def log_path(self) -> Path:
        return self.work / "container.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def user(self) -> tuple[int, int]:
        context = {**self.pod.get("securityContext", {}), **self.spec.get("securityContext", {})}
        return context["runAsUser"], context["runAsGroup"]

    def environment(self) -> dict[str, str]:
        """The image's environment, then the Deployment's envFrom and env, as the kubelet
        composes them; then the two overrides the shared network needs."""
        env = self.image.env()
        for source in self.spec.get("envFrom", []):
            env.update(self.config_maps[source["configMapRef"]["name"]])
        for item in self.spec.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = self.secrets[ref["name"]][ref["key"]].decode()
        env.update({"CRYPTD_HOST": "127.0.0.1", "CRYPTD_PORT": str(self.port)})
        return env

    def command(self) -> list[str]:
        entrypoint = self.spec.get("command", self.image.config.get("Entrypoint") or [])
        args = self.spec["args"] if "args" in self.spec else self.image.config.get("Cmd") or []
        return [*entrypoint, *args]

    def _publish(self, name: str, generation: int = 1) -> Path:
        """Write Secret ``name`` on the host the way the kubelet does (its atomic writer; the
        volume's mode, group-owned by the fsGroup); the container sees it through a bind
        mount, so a later generation is an update of the Secret the kubelet synced."""
        volume = next(
            v for v in self.pod["volumes"] if v.get("secret", {}).get("secretName") == name
        )
        source = self.work / "secrets" / name
        publish_secret(source, self.secrets[name], generation)
        fs_group = self.pod["securityContext"]["fsGroup"]
        mode = volume["secret"].get("defaultMode", 0o644)
        for path in source.rglob("*"):
            os.lchown(path, 0, fs_group)
            if path.is_file() and not path.is_symlink():
                path.chmod(mode)
        return source

    def update_secret(self, name: str, files: dict[str, bytes]) -> None:
        """A new version of a mounted Secret, as the kubelet syncs it into a running pod."""
        self.secrets[name] = files
        self.generations[name] = self.generations.get(name, 1) + 1
        self._publish(name, self.generations[name])

    def _mounts(self) -> list[str]:
        """Shell lines mounting the Deployment's volumes over the read-only root."""
        root = self.image.rootfs
        fs_group = self.pod["securityContext"]["fsGroup"]
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        q = shlex.quote
        lines: list[str] = []
        for mount in self.spec["volumeMounts"]:
            volume = volumes[mount["name"]]
            target = q(str(root / mount["mountPath"].lstrip("/")))
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                assert name in self.secrets, f"the test does not provide Secret {name}"
                assert mount.get("readOnly"), f"Secret {name} mounted writable"
                assert "subPath" not in mount
                source = self._publish(name)
                lines += [
                    f"mount --bind {q(str(source))} {target}",
                    f"mount -o remount,bind,ro {target}",
                ]
            elif "emptyDir" in volume:
                size = _size(volume["emptyDir"]["sizeLimit"])
                # The kubelet's emptyDir: mode 0777, group-owned by the fsGroup, setgid.
                lines.append(
                    f"mount -t tmpfs -o nosuid,nodev,size={size},mode=2777,gid={fs_group} "
                    f"tmpfs {target}"
                )
            else:
                pytest.fail(f"volume {mount['name']}: only secret and emptyDir are emulated")
        return lines

    def start(self) -> None:
        root = self.image.rootfs
        # Mount points, made before the root turns read-only (an engine makes them in the
        # container's own layer).
        for mount in self.spec["volumeMounts"]:
            (root / mount["mountPath"].lstrip("/")).mkdir(parents=True, exist_ok=True)
        uid, gid = self.user()
        launch = {
            "root": str(root),
            "uid": uid,
            "gid": gid,
            "cwd": self.image.config.get("WorkingDir") or "/",
            "env": self.environment(),
            "argv": self.command(),
        }
        q = shlex.quote
        r = q(str(root))
        devices = ("null", "zero", "full", "random", "urandom", "tty")
        script = [
            "set -eu",
            f"mount --bind {r} {r}",
            f"mount -o remount,bind,ro,nosuid,nodev {r}",
            f"mount -t proc -o nosuid,nodev,noexec proc {r}/proc",
            f"mount -t sysfs -o ro,nosuid,nodev,noexec sysfs {r}/sys",
            f"mount -t tmpfs -o nosuid,mode=0755,size=64k tmpfs {r}/dev",
            *[f"touch {r}/dev/{d} && mount --bind /dev/{d} {r}/dev/{d}" for d in devices],
            f"mkdir {r}/dev/shm {r}/dev/pts",
            f"mount -t tmpfs -o nosuid,nodev,noexec,mode=1777,size=64m shm {r}/dev/shm",
            f"ln -s /proc/self/fd {r}/dev/fd",
            *[
                f"ln -s /proc/self/fd/{n} {r}/dev/{name}"
                for n, name in enumerate(("stdin", "stdout", "stderr"))
            ],
            *self._mounts(),
            f"exec {q(sys.executable)} {q(str(LAUNCH))} {q(json.dumps(launch))}",
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    tool("unshare"),
                    "--mount",
                    "--pid",
                    "--ipc",
                    "--uts",
                    "--fork",
                    "--kill-child",
                    "--propagation",
                    "private",
                    "/bin/bash",
                    "-c",
                    "\n".join(script),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def pid1(self) -> int:
        """The host's PID of the container's PID 1 (the forked child of unshare)."""
        assert self.process is not None
        for _ in range(100):
            for status in Path("/proc").glob("[0-9]*/status"):
                with contextlib.suppress(OSError, ValueError):
                    fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
                    if int(fields["PPid"]) == self.process.pid:
                        return int(status.parent.name)
            time.sleep(0.05)
        pytest.fail("the container's PID 1 was not found")

    def exec(
        self, argv: list[str], *, env: dict[str, str] | None = None, as_root: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the running container (its mount and PID namespaces, its root,
        the image's user and environment), as `kubectl exec` or an engine's HEALTHCHECK does."""
        uid, gid = self.user()
        launch = {
            "root": str(self.image.rootfs),
            "uid": uid,
            "gid": gid,
            "cwd": self.image.config.get("WorkingDir") or "/",
            "env": env if env is not None else self.environment(),
            "argv": argv,
            "keep_privileges": as_root,
        }
        return subprocess.run(
            [
                tool("nsenter"),
                "--target",
                str(self.pid1()),
                "--mount",
                "--pid",
                "--",
                sys.executable,
                str(LAUNCH),
                json.dumps(launch),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def wait_ready(self, timeout: float = 90) -> None:
        probe = self.spec["readinessProbe"]["httpGet"]["path"]
        deadline = time.monotonic() + timeout
        assert self.process is not None
        while True:
            assert self.process.poll() is None, self.log()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + probe, timeout=1, verify=self.verify()).status_code == 200:
                    return
            assert time.monotonic() < deadline, "not ready:\n" + self.log()[-3000:]
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGKILL to PID 1, which ends every process of its PID namespace."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1(), signal.SIGKILL)
            self.process.wait(timeout=30)


def _tls_secret(ca: Issued | None = None) -> dict[str, bytes]:
    """The server's TLS Secret in cert-manager's layout: a private CA (``ca``, or a new one)
    and a certificate it issued for the Certificate's DNS names, plus the loopback address the
    test connects to (the host's network is shared)."""
    ca = ca or make_ca("cryptd image test CA")
    leaf = issue(ca, [*_server_certificate()["spec"]["dnsNames"], "127.0.0.1"])
    # tls.crt holds the chain, leaf first, as cert-manager writes it.
    return {
        "tls.crt": leaf.cert_pem() + ca.cert_pem(),
        "tls.key": leaf.key_pem(),
        "ca.crt": ca.cert_pem(),
    }


KEYS = (("payments", "aes256-gcm"), ("seal", "sm2"), ("bulk", "rsa-4096"))


def _secrets(
    work: Path,
    redis_url: str,
    keystore: KeyStore | None = None,
    keys: tuple[tuple[str, str], ...] = KEYS,
) -> tuple[dict[str, dict[str, bytes]], tuple[str, str]]:
    """The Deployment's Secrets, made with the project's CLI: a master key, a keyring with the
    keys the tests use, one client allowed everything (key management included), the server's
    TLS certificate. With ``keystore`` (the PostgreSQL deployment) the keyring is copied into
    that database and the Secrets are the overlay's: the URL and the database's CA instead of
    the keyring. Returns them and the client's (id, secret)."""
    cryptd = str(cryptd_shim(work / "bin"))
    made = work / "made"
    made.mkdir()
    master, keyring, clients = made / "master.key", made / "keyring.json", made / "clients.json"
    subprocess.run([cryptd, "master-key", "generate", "--out", str(master)], check=True)
    for name, key_type in keys:
        subprocess.run(
            [
                cryptd,
                "keys",
                "create",
                name,
                "--type",
                key_type,
                "--keyring",
                str(keyring),
                "--master-key-file",
                str(master),
            ],
            check=True,
            capture_output=True,
        )
    added = subprocess.run(
        [cryptd, "clients", "add", "app", "--admin", "--allow", "*:*", "--file", str(clients)],
        check=True,
        capture_output=True,
        text=True,
    )
    secret = added.stdout.split()[0]
    tls_name = _server_certificate()["spec"]["secretName"]
    secrets = {
        "cryptd-master-key": {"master.key": master.read_bytes()},
        "cryptd-clients": {"clients.json": clients.read_bytes()},
        "cryptd-redis": {"url": redis_url.encode()},
        tls_name: _tls_secret(),
    }
    if keystore is None:
        secrets["cryptd-keyring"] = {"keyring.json": keyring.read_bytes()}
    else:
        subprocess.run(
            [
                cryptd,
                "keystore",
                "copy",
                str(keyring),
                keystore.copy_url,
                "--master-key-file",
                str(master),
            ],
            check=True,
            capture_output=True,
        )
        secrets["cryptd-keystore"] = {"url": keystore.url.encode()}
        # Without a CA of its own the database is reached without TLS (a loopback server,
        # which production allows for local hosts only): the mount is there, unused.
        secrets["cryptd-keystore-ca"] = {"ca.crt": keystore.ca or secrets[tls_name]["ca.crt"]}
    return secrets, ("app", secret)


@dataclass
class Running:
    container: Container
    client_id: str
    secret: str

    def client(self, timeout: float = 30, retries: int = 3) -> CryptdClient:
        return CryptdClient(
            self.container.url,
            self.client_id,
            self.secret,
            timeout=timeout,
            retries=retries,
            ca_file=self.container.ca_file,
        )


@contextlib.contextmanager
def running(
    image: Image,
    pod: dict[str, Any],
    redis_url: str,
    *,
    config_maps: dict[str, dict[str, str]] | None = None,
    keystore: KeyStore | None = None,
    keys: tuple[tuple[str, str], ...] = KEYS,
) -> Iterator[Running]:
    require_cli()
    with world_tempdir() as work:
        secrets, (client_id, secret) = _secrets(work, redis_url, keystore, keys)
        container = Container(image, pod, secrets, work, config_maps or _base_config_maps())
        container.start()
        try:
            container.wait_ready()
            yield Running(container, client_id, secret)
        finally:
            container.stop()


@pytest.fixture(scope="module")
def served(image: Image, pod: dict[str, Any], redis_url: str) -> Iterator[Running]:
    with running(image, pod, redis_url) as run:
        yield run


# --- the image as built ------------------------------------------------------------------------


def test_image_metadata_agrees_with_the_deployment(image: Image, pod: dict[str, Any]) -> None:
    container = _container_spec(pod)
    config = image.config
    context = {**pod["securityContext"], **container["securityContext"]}
    assert image.user() == (context["runAsUser"], context["runAsGroup"])
    assert image.user()[0] != 0
    ports = {f"{p['containerPort']}/{p['protocol'].lower()}" for p in container["ports"]}
    assert set(config["ExposedPorts"]) == ports
    assert config["StopSignal"] == "SIGTERM"
    assert config["Entrypoint"] == ["/usr/local/bin/cryptd-entrypoint"]
    health = config["Healthcheck"]
    assert health["Test"][0] == "CMD"  # exec form: no shell
    assert health["Timeout"] <= 3 * 10**9
    env = image.env()
    literals = _config_map("cryptd-config")
    shared = set(env) & set(literals)
    assert {name: env[name] for name in shared} == {name: literals[name] for name in shared}


@pytest.mark.parametrize("package", ["service", "client/cryptd_client"])
def test_image_holds_this_checkouts_code(image: Image, package: str) -> None:
    # The image must be built from what is tested: every module, byte for byte.
    name = package.rsplit("/", 1)[-1]
    installed = list(image.rootfs.glob(f"usr/local/lib/python3*/*-packages/{name}"))
    assert len(installed) == 1, f"{name} is not installed in the image"
    source = {p.relative_to(ROOT / package): p for p in (ROOT / package).rglob("*.py")}
    built = {p.relative_to(installed[0]): p for p in installed[0].rglob("*.py")}
    assert source
    assert set(built) == set(source), "rebuild the image: .ci/build-image"
    stale = [
        str(rel) for rel, path in source.items() if path.read_bytes() != built[rel].read_bytes()
    ]
    assert not stale, f"rebuild the image (.ci/build-image): {stale}"


def test_image_scripts_are_this_checkouts(image: Image) -> None:
    for inside, checkout in (
        ("/usr/local/bin/cryptd-entrypoint", "docker/entrypoint.sh"),
        ("/usr/local/lib/cryptd/healthcheck.py", "docker/healthcheck.py"),
        ("/usr/local/lib/cryptd/check_libcrypto.py", "docker/check_libcrypto.py"),
    ):
        assert image.path(inside).read_bytes() == (ROOT / checkout).read_bytes(), inside


def _image_python(image: Image) -> dict[str, str]:
    """The image's interpreter as a PEP 508 marker environment."""
    probe = subprocess.run(
        [
            tool("chroot"),
            str(image.rootfs),
            "python",
            "-c",
            "import json, platform, sys; print(json.dumps({'python_full_version': "
            "platform.python_version(), 'python_version': '%d.%d' % sys.version_info[:2], "
            "'sys_platform': sys.platform}))",
        ],
        env={"PATH": image.env()["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    )
    found: dict[str, str] = json.loads(probe.stdout)
    return found


def test_image_installs_the_pinned_dependencies(image: Image) -> None:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    lock = _module(ROOT / "docker" / "update_constraints.py")
    pins = lock.read_constraints()
    packages = next(image.rootfs.glob("usr/local/lib/python3*/*-packages"))
    installed: dict[str, str] = {}
    requires: list[Requirement] = []
    for metadata in packages.glob("*.dist-info/METADATA"):
        headers = [
            line.split(": ", 1) for line in metadata.read_text().splitlines() if ": " in line
        ]
        name = next(v for k, v in headers if k == "Name")
        installed[lock.canonical(name)] = next(v for k, v in headers if k == "Version")
        requires += [Requirement(v) for k, v in headers if k == "Requires-Dist"]
    assert installed.pop("cryptd") == _project_version()
    assert {name: installed.get(name) for name in pins} == pins
    # Anything beyond the pins is there only because the image's Python is older than the
    # tested one (docs/DEPLOY.md: Debian's 3.11.2 makes redis add async-timeout).
    environment = cast("dict[str, str]", default_environment())  # a TypedDict of strings
    image_env = {**environment, **_image_python(image), "extra": ""}
    tested_env = {**environment, "extra": ""}
    for name in set(installed) - set(pins):
        reasons = [
            r
            for r in requires
            if lock.canonical(r.name) == name
            and r.marker is not None
            and r.marker.evaluate(image_env)
            and not r.marker.evaluate(tested_env)
        ]
        assert reasons, f"{name} {installed[name]} is installed but not pinned"


def _module(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _project_version() -> str:
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as fh:
        version: str = tomllib.load(fh)["project"]["version"]
    return version


def test_image_files_and_modes(image: Image) -> None:
    uid, gid = image.user()
    assert stat.S_IMODE(image.path("/usr/local/bin/cryptd-entrypoint").stat().st_mode) == 0o555
    for script in ("healthcheck.py", "check_libcrypto.py"):
        mode = image.path(f"/usr/local/lib/cryptd/{script}").stat().st_mode
        assert stat.S_IMODE(mode) == 0o444
    metrics = image.path(image.env()["PROMETHEUS_MULTIPROC_DIR"]).stat()
    assert (metrics.st_uid, metrics.st_gid, stat.S_IMODE(metrics.st_mode)) == (uid, gid, 0o750)
    # pip, setuptools and wheel left the runtime stage; the service's console script is there.
    packages = next(image.rootfs.glob("usr/local/lib/python3*/*-packages"))
    assert not [p.name for p in packages.iterdir() if re.match(r"(pip|setuptools|wheel)\b", p.name)]
    assert not image.path("/usr/local/bin/pip").exists()
    assert os.access(image.path("/usr/local/bin/cryptd"), os.X_OK)
    # Nothing the image's user could change: no world-writable path but sticky directories,
    # nothing owned by that user but the metrics directory.
    writable, owned = [], []
    for path in image.rootfs.rglob("*"):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        if st.st_mode & stat.S_IWOTH and not (
            stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        ):
            writable.append(str(path.relative_to(image.rootfs)))
        if st.st_uid == uid:
            owned.append(str(path.relative_to(image.rootfs)))
    assert writable == []
    assert owned == [image.env()["PROMETHEUS_MULTIPROC_DIR"].lstrip("/")]


def test_prestop_command_needs_no_shell(image: Image, pod: dict[str, Any]) -> None:
    # The Deployment execs its preStop command directly: it must exist on the image's PATH.
    command = _container_spec(pod)["lifecycle"]["preStop"]["exec"]["command"]
    found = [
        image.path(f"{directory}/{command[0]}")
        for directory in image.env()["PATH"].split(":")
        if os.access(image.path(f"{directory}/{command[0]}"), os.X_OK)
    ]
    assert found, f"{command[0]} is not on the image's PATH"


# --- the image running ---------------------------------------------------------------------------


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines())}


def test_serves_signed_requests(served: Running) -> None:
    with served.client() as cryptd:
        token = cryptd.encrypt("payments", b"card 4111").ciphertext
        assert cryptd.decrypt("payments", token).plaintext == b"card 4111"
        # SM2 goes to the image's own libcrypto.
        signature = cryptd.sign("seal", b"statement").signature
        assert cryptd.verify("seal", b"statement", signature=signature)
        assert not cryptd.verify("seal", b"statement!", signature=signature)
        # RSA-4096 runs on the process pool (fork, semaphores on /dev/shm).
        signed = cryptd.sign_batch("bulk", [b"a", b"b", b"c"])
        assert all(not isinstance(item, Exception) for item in signed)
        # Key management would write the read-only keyring Secret: refused, not attempted.
        with pytest.raises(ConflictError):
            cryptd.create_key("other", "aes256-gcm")
    metrics = httpx.get(
        served.container.url + "/metrics", timeout=10, verify=served.container.verify()
    )
    assert metrics.status_code == 200
    assert "cryptd_" in metrics.text


def test_serves_tls_only_with_the_mounted_certificate(served: Running) -> None:
    container = served.container
    assert container.scheme == "https"
    # The handshake: TLS 1.3, the certificate from the Secret, verified against its CA.
    with (
        socket.create_connection(("127.0.0.1", container.port), timeout=10) as raw,
        container.verify().wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.version() == "TLSv1.3"
        served_cert = tls.getpeercert(binary_form=True)
    assert served_cert == _leaf_der(container.secrets["cryptd-tls"]["tls.crt"])
    # TLS 1.1 is refused at the handshake by the image's OpenSSL (a client that offers only
    # that, its own security level lowered so that it does offer it).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    old.load_verify_locations(container.ca_file)
    with (
        socket.create_connection(("127.0.0.1", container.port), timeout=10) as raw,
        pytest.raises((ssl.SSLError, ConnectionResetError)),
    ):
        old.wrap_socket(raw, server_hostname="127.0.0.1")
    # Nothing answers in clear text.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{container.port}/healthz", timeout=5)
    # A client that does not trust the CA does not connect.
    with pytest.raises(httpx.ConnectError):
        httpx.get(container.url + "/healthz", timeout=5, verify=ssl.create_default_context())


def _leaf_der(chain_pem: bytes) -> bytes:
    """The first certificate of a PEM chain, DER."""
    end = "-----END CERTIFICATE-----"
    return ssl.PEM_cert_to_DER_cert(chain_pem.decode().split(end)[0] + end + "\n")


def _served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_a_renewed_certificate_is_served_without_a_restart(served: Running) -> None:
    """cert-manager renews: the kubelet swaps the Secret's files under the running pod. Every
    worker moves new handshakes to the new certificate; a kept-alive connection goes on
    answering; no process restarts."""
    container = served.container

    def server_processes() -> set[int]:  # the supervisor and its server workers
        pid1 = container.pid1()
        return {pid1} | {p for p in _descendants(pid1) if _status(p)["PPid"] == str(pid1)}

    processes = server_processes()
    kept = http.client.HTTPSConnection(
        "127.0.0.1", container.port, timeout=10, context=container.verify()
    )

    def kept_answers() -> socket.socket | None:
        kept.request("GET", "/healthz")
        response = kept.getresponse()
        response.read()
        assert response.status == 200
        return kept.sock

    try:
        first = kept_answers()
        renewed = _tls_secret()  # a new CA too: an old certificate cannot pass for the new one
        container.update_secret("cryptd-tls", renewed)
        trust_renewed = ssl.create_default_context(cadata=renewed["ca.crt"].decode())
        # Both workers (SO_REUSEPORT spreads connections over them): ten new handshakes in a
        # row present the new certificate.
        deadline, in_a_row = time.monotonic() + 20, 0
        while in_a_row < 10:
            assert time.monotonic() < deadline, "new handshakes still get the old certificate"
            try:
                served_now = _served_certificate(container.port, trust_renewed)
            except ssl.SSLCertVerificationError:
                in_a_row = 0
                assert kept_answers() is first  # the same connection, well inside keep-alive
                time.sleep(0.2)
                continue
            assert served_now == _leaf_der(renewed["tls.crt"])
            in_a_row += 1
        assert kept_answers() is first
    finally:
        kept.close()
    assert server_processes() == processes
    log = container.log()
    assert "do not load" not in log
    assert "Traceback" not in log, log[-3000:]


def test_runs_as_the_image_user_without_privileges(served: Running) -> None:
    container = served.container
    pid1 = container.pid1()
    uid, gid = container.user()
    processes = [pid1, *_descendants(pid1)]
    assert len(processes) >= 3, "expected the supervisor, two workers and their pools"
    for pid in processes:
        status = _status(pid)
        assert status["Uid"].split() == [str(uid)] * 4, (pid, status["Uid"])
        assert status["Gid"].split() == [str(gid)] * 4, (pid, status["Gid"])
        assert status["Groups"] == ""
        for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[caps], 16) == 0, (pid, caps, status[caps])
        assert status["NoNewPrivs"] == "1"
        assert os.readlink(f"/proc/{pid}/root") == str(container.image.rootfs)
    # PID 1 in the container is the server itself (the entrypoint exec'd it).
    cmdline = Path(f"/proc/{pid1}/cmdline").read_bytes().split(b"\0")
    assert b"serve" in cmdline, cmdline
    ns_pid = _status(pid1)["NSpid"].split()
    assert ns_pid[-1] == "1"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError, KeyError, ValueError):
            ppid = int(_status(int(status.parent.name))["PPid"])
            children.setdefault(ppid, []).append(int(status.parent.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def test_root_filesystem_is_read_only(served: Running) -> None:
    container = served.container
    # Even root inside the container cannot write to the image's files.
    probe = container.exec(
        ["python", "-c", "open('/usr/local/lib/cryptd/probe', 'w')"], as_root=True
    )
    assert probe.returncode != 0
    assert "Read-only file system" in probe.stderr, probe.stderr
    # The image's user can write to the two emptyDirs only.
    writes = container.exec(
        [
            "python",
            "-c",
            "import os, tempfile\n"
            "for d in ('/tmp', os.environ['PROMETHEUS_MULTIPROC_DIR']):\n"
            "    tempfile.NamedTemporaryFile(dir=d).close()\n"
            "for d in ('/', '/etc', '/usr/local', '/run', '/etc/cryptd/keyring'):\n"
            "    try:\n"
            "        tempfile.NamedTemporaryFile(dir=d).close()\n"
            "    except OSError:\n"
            "        continue\n"
            "    raise SystemExit(f'{d} is writable')\n",
        ]
    )
    assert writes.returncode == 0, writes.stderr
    assert "Read-only file system" not in container.log()


def test_the_image_healthcheck_command(served: Running, image: Image) -> None:
    container = served.container
    command = image.config["Healthcheck"]["Test"][1:]
    healthy = container.exec(command)
    assert healthy.returncode == 0, healthy.stderr
    # The same command fails when nothing answers on the port it follows.
    port = free_port()
    env = {**container.environment(), "CRYPTD_PORT": str(port)}
    failed = container.exec(command, env=env)
    assert failed.returncode == 1
    assert failed.stderr.startswith(f"healthcheck: https://127.0.0.1:{port}/healthz: "), failed


@pytest.mark.parametrize(
    ("secret", "key", "variable"),
    [
        ("cryptd-clients", "clients.json", "CRYPTD_CLIENTS_FILE"),
        ("cryptd-tls", "tls.key", "CRYPTD_TLS_KEY_FILE"),
    ],
)
def test_a_missing_secret_stops_the_container_with_a_clear_message(
    image: Image, pod: dict[str, Any], redis_url: str, secret: str, key: str, variable: str
) -> None:
    require_cli()
    with world_tempdir() as work:
        secrets, _ = _secrets(work, redis_url, keys=KEYS[:1])  # never served: no RSA key made
        secrets[secret][key] = b""
        container = Container(image, pod, secrets, work)
        container.start()
        assert container.process is not None
        try:
            returncode = container.process.wait(timeout=30)
        finally:
            container.stop()
        log = container.log()
    assert returncode == 78, log  # EX_CONFIG, from the image's entrypoint
    path = container.environment()[variable]
    assert f"cryptd-entrypoint: error: {variable}={path} is empty" in log


def test_prestop_then_sigterm_drains_and_exits_zero(
    image: Image, pod: dict[str, Any], redis_url: str
) -> None:
    prestop = _container_spec(pod)["lifecycle"]["preStop"]["exec"]["command"]
    with running(image, pod, redis_url) as run:
        container = run.container
        assert container.process is not None
        # The kubelet runs preStop while the endpoint is being removed; the server keeps
        # serving, then gets SIGTERM as PID 1.
        hook: dict[str, subprocess.CompletedProcess[str]] = {}
        hook_thread = threading.Thread(target=lambda: hook.update(done=container.exec(prestop)))
        hook_thread.start()
        with run.client() as cryptd:
            while hook_thread.is_alive():
                assert cryptd.healthz()["status"] == "ok"
                time.sleep(0.2)
        hook_thread.join()
        assert hook["done"].returncode == 0, hook["done"].stderr

        long: dict[str, Any] = {}

        def long_request() -> None:
            # ~0.6 s of RSA-4096 on two idle cores (200 took under 0.3 s on a quiet machine,
            # ending before the signal); well inside the 5 s pool deadline.
            messages = [os.urandom(32) for _ in range(LONG_BATCH)]
            try:
                # No retry: a request the server dropped must show as lost.
                with run.client(timeout=GRACE_SECONDS, retries=0) as cryptd:
                    long["result"] = cryptd.sign_batch("bulk", messages)
            except Exception as exc:  # reported below
                long["result"] = exc
            long["ended"] = time.monotonic()

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(0.15)  # on its way and being worked on
        signalled = time.monotonic()
        os.kill(container.pid1(), signal.SIGTERM)
        try:
            returncode = container.process.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {GRACE_SECONDS} s after SIGTERM: the kubelet kills it")
        worker.join(timeout=GRACE_SECONDS)
        log = container.log()
    assert returncode == 0, log[-3000:]
    result = long.get("result")
    assert isinstance(result, list), f"the in-flight request was lost: {result!r}"
    assert len(result) == LONG_BATCH
    assert all(not isinstance(item, Exception) for item in result)
    assert long["ended"] > signalled, "the request ended before SIGTERM: nothing drained"
    assert "Finished server process" in log, log[-3000:]
    assert "Read-only file system" not in log
    assert "Traceback" not in log, log[-3000:]


# --- the PostgreSQL deployment (k8s/postgresql) ----------------------------------------------


@dataclass(frozen=True)
class Overlay:
    pod: dict[str, Any]
    config_maps: dict[str, dict[str, str]]

    def mount_path(self, volume: str) -> str:
        container = _container_spec(self.pod)
        path: str = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume)
        return path


@pytest.fixture(scope="module")
def postgresql_overlay() -> Overlay:
    """The server pod and ConfigMaps of `kubectl kustomize k8s/postgresql`."""
    from tests import test_k8s as k8s

    rendered = k8s.render_with_kustomize(K8S / "postgresql")
    return Overlay(
        k8s.pod_spec(k8s.server(rendered)),
        {d["metadata"]["name"]: d["data"] for d in rendered if d["kind"] == "ConfigMap"},
    )


def test_serves_and_manages_keys_on_postgresql(
    image: Image, redis_url: str, pg_database: str, postgresql_overlay: Overlay
) -> None:
    """The k8s/postgresql overlay's pod on the image: the key store in a database of this
    test's own on the real PostgreSQL, reached with the image's psycopg (and its libpq)."""
    import psycopg

    pod, config_maps = postgresql_overlay.pod, postgresql_overlay.config_maps
    # No RSA-4096 key: the process pool is exercised on the file deployment.
    with running(
        image,
        pod,
        redis_url,
        config_maps=config_maps,
        keystore=KeyStore(pg_database, pg_database),
        keys=KEYS[:2],
    ) as run:
        environment = run.container.environment()
        assert environment["CRYPTD_KEYSTORE_URL"] == pg_database
        assert environment["CRYPTD_KEYRING_READ_ONLY"] == "false"
        with run.client() as cryptd:
            # The keys copied into the database serve (SM2 through the image's libcrypto).
            token = cryptd.encrypt("payments", b"card 4111").ciphertext
            assert cryptd.decrypt("payments", token).plaintext == b"card 4111"
            signature = cryptd.sign("seal", b"statement").signature
            assert cryptd.verify("seal", b"statement", signature=signature)
            # Key management is written to the database through the API.
            cryptd.create_key("ledger", "aes256-gcm")
            rotated = cryptd.rotate_key("payments")
            assert rotated.latest_version == 2
            sealed = cryptd.encrypt("ledger", b"entry").ciphertext
            assert cryptd.decrypt("ledger", sealed).plaintext == b"entry"
            assert cryptd.decrypt("payments", token).plaintext == b"card 4111"
        readiness = httpx.get(run.container.url + "/readyz", verify=run.container.verify())
        assert readiness.json()["status"] == "ready", readiness.text
        log = run.container.log()
    with psycopg.connect(pg_database) as conn:
        names = {row[0] for row in conn.execute("SELECT name FROM cryptd_keys")}
        versions = conn.execute(
            "SELECT max(version) FROM cryptd_key_versions WHERE name = 'payments'"
        ).fetchone()
    assert names == {"payments", "seal", "ledger"}
    assert versions == (2,)
    assert "Traceback" not in log, log[-3000:]
    assert "Read-only file system" not in log


def test_the_key_store_over_tls_verified_against_the_mounted_ca(
    image: Image, redis_url: str, postgresql_overlay: Overlay
) -> None:
    """The overlay's URL form (sslmode=verify-full, sslrootcert on the cryptd-keystore-ca
    mount) against a private PostgreSQL that accepts TLS only: the image's libpq verifies the
    database's certificate against the mounted CA, and a pod given another CA does not start."""
    import psycopg

    from tests.test_keystore_support import private_postgres

    pod, config_maps = postgresql_overlay.pod, postgresql_overlay.config_maps
    ca_inside = postgresql_overlay.mount_path("keystore-ca") + "/ca.crt"
    database_ca = make_ca("database CA")
    database = issue(database_ca, ["127.0.0.1"])
    chain = database.cert_pem() + database_ca.cert_pem()
    with private_postgres(tls=(chain, database.key_pem())) as cluster, world_tempdir() as host:
        (host / "ca.crt").write_bytes(database_ca.cert_pem())

        def store(name: str, ca: bytes) -> KeyStore:
            base = f"postgresql://postgres@127.0.0.1:{cluster.port}/{name}?sslmode=verify-full"
            return KeyStore(
                f"{base}&sslrootcert={ca_inside}", f"{base}&sslrootcert={host / 'ca.crt'}", ca
            )

        good = store("postgres", database_ca.cert_pem())
        with running(
            image, pod, redis_url, config_maps=config_maps, keystore=good, keys=KEYS[:1]
        ) as run:
            with run.client() as cryptd:
                token = cryptd.encrypt("payments", b"over TLS").ciphertext
                assert cryptd.decrypt("payments", token).plaintext == b"over TLS"
                cryptd.create_key("ledger", "aes256-gcm")
            assert "Traceback" not in run.container.log()
        # Nothing reaches this cluster in clear text (hostssl only): the pod spoke TLS.
        with psycopg.connect(good.copy_url, autocommit=True) as conn:
            assert {row[0] for row in conn.execute("SELECT name FROM cryptd_keys")} == {
                "payments",
                "ledger",
            }
            conn.execute("CREATE DATABASE other")
        plain = f"postgresql://postgres@127.0.0.1:{cluster.port}/postgres?sslmode=disable"
        with pytest.raises(psycopg.OperationalError, match=r"no pg_hba\.conf entry"):
            psycopg.connect(plain, connect_timeout=5).close()
        # Another CA than the one that signed the database's certificate: refused.
        with world_tempdir() as work:
            wrong = store("other", make_ca("another CA").cert_pem())
            secrets, _ = _secrets(work, redis_url, wrong, keys=KEYS[:1])
            container = Container(image, pod, secrets, work, config_maps)
            container.start()
            assert container.process is not None
            try:
                returncode = container.process.wait(timeout=60)
            finally:
                container.stop()
            log = container.log()
    assert returncode != 0, log[-3000:]
    assert "is unreachable" in log, log[-3000:]
    assert "certificate verify failed" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert secrets["cryptd-master-key"]["master.key"].strip().decode() not in log


def test_mutual_tls_as_the_deployment_guide_sets_it_up(
    image: Image, pod: dict[str, Any], redis_url: str
) -> None:
    """docs/DEPLOY.md's mutual TLS: CRYPTD_TLS_CLIENT_CA_FILE on the TLS Secret's ca.crt and
    CRYPTD_TLS_CLIENT_CERT=optional so the probes (which present no certificate) pass; client
    certificates from the same CA. A certificate-only client is served without a signature, a
    signing client without a certificate still is, another CA's certificate is refused at the
    handshake, and the image's HEALTHCHECK passes."""
    require_cli()
    ca = make_ca("cryptd mutual TLS CA")
    identity = "spiffe://cluster.local/ns/payroll/sa/payroll"
    config = {
        "cryptd-config": {
            **_config_map("cryptd-config"),
            "CRYPTD_TLS_CLIENT_CA_FILE": "/etc/cryptd/tls/ca.crt",
            "CRYPTD_TLS_CLIENT_CERT": "optional",
        }
    }
    with world_tempdir() as work:
        secrets, (client_id, secret) = _secrets(work, redis_url, keys=KEYS[:1])
        secrets["cryptd-tls"] = _tls_secret(ca)
        clients = work / "made" / "clients.json"
        subprocess.run(
            [
                str(work / "bin" / "cryptd"),
                "clients",
                "add",
                "payroll",
                "--certificate",
                identity,
                "--certificate-only",
                "--allow",
                "payments:encrypt",
                "--file",
                str(clients),
            ],
            check=True,
            capture_output=True,
        )
        secrets["cryptd-clients"] = {"clients.json": clients.read_bytes()}
        for name, issued in (
            ("payroll", issue(ca, [identity], server=False, client=True)),
            ("stranger", issue(make_ca("another CA"), [identity], server=False, client=True)),
        ):
            (work / f"{name}.crt").write_bytes(issued.cert_pem())
            (work / f"{name}.key").write_bytes(issued.key_pem())
        container = Container(image, pod, secrets, work, config)
        container.start()
        try:
            container.wait_ready()  # the readiness probe's request: no client certificate
            health = container.exec(image.config["Healthcheck"]["Test"][1:])
            assert health.returncode == 0, health.stderr
            body = {"plaintext": "cGF5c2xpcA=="}
            headers = {"Content-Type": "application/json"}
            payroll = container.verify()
            payroll.load_cert_chain(work / "payroll.crt", work / "payroll.key")
            with httpx.Client(verify=payroll, timeout=10) as http:
                sealed = http.post(
                    container.url + "/v1/encrypt/payments", json=body, headers=headers
                )
                assert sealed.status_code == 200, sealed.text
                # Its policy holds: encrypt only.
                opened = http.post(
                    container.url + "/v1/decrypt/payments", json=sealed.json(), headers=headers
                )
                assert opened.status_code == 403, opened.text
            # Unsigned and without a certificate: nobody.
            anonymous = httpx.post(
                container.url + "/v1/encrypt/payments",
                json=body,
                headers=headers,
                verify=container.verify(),
                timeout=10,
            )
            assert anonymous.status_code == 401, anonymous.text
            # A signing client needs no certificate.
            with Running(container, client_id, secret).client() as cryptd:
                token = cryptd.encrypt("payments", b"payslip").ciphertext
                assert cryptd.decrypt("payments", token).plaintext == b"payslip"
            # Another CA's certificate: refused at the handshake.
            stranger = container.verify()
            stranger.load_cert_chain(work / "stranger.crt", work / "stranger.key")
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                httpx.post(
                    container.url + "/v1/encrypt/payments",
                    json=body,
                    headers=headers,
                    verify=stranger,
                    timeout=10,
                )
            assert container.process is not None
            assert container.process.poll() is None
        finally:
            container.stop()
        log = container.log()
    assert "Traceback" not in log, log[-3000:]
