"""The Kubernetes manifests: schemas, lint, kustomize rendering, cross-references and a
security review, point by point.

Every check on a rendered deployment runs twice: on a rendering done here from the files the
kustomizations name (resources, generators, namespace, images; patches are not applied), and
on the output of the real kustomize (`kubectl kustomize`), which is what a cluster receives.
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from tests.test_k8s_support import K8S, ROOT, load_docs, parse_docs, tool

Doc = dict[str, Any]

KUSTOMIZATIONS = sorted(
    path.parent
    for pattern in (
        "base/kustomization.yaml",
        "redis/kustomization.yaml",
        "overlays/*/kustomization.yaml",
    )
    for path in K8S.glob(pattern)
)
OVERLAYS = [path for path in KUSTOMIZATIONS if path.parent.name == "overlays"]
MANIFESTS = sorted(
    path
    for directory in ("base", "redis", "overlays")
    for path in (K8S / directory).rglob("*.yaml")
    if path.name != "kustomization.yaml"
)
# Oldest and newest Kubernetes minor versions the manifests are checked against.
K8S_VERSIONS = ["1.29.0", "1.33.0", "1.37.0"]
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
SERVER_LABELS = {"app.kubernetes.io/name": "cryptd", "app.kubernetes.io/component": "server"}
REDIS_LABELS = {
    "app.kubernetes.io/name": "cryptd-redis",
    "app.kubernetes.io/component": "replay-store",
}
PREFERRED_DRAIN_BOUND = 30  # seconds, when cryptd serve does not state its own

# The ServiceMonitor CRD is not in the Kubernetes schemas: the fields used here, from the
# Prometheus Operator's monitoring.coreos.com/v1 CRD, closed so that a typo fails.
DURATION = r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                            "tlsConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "ca": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "secret": {
                                                "type": "object",
                                                "additionalProperties": False,
                                                "required": ["name", "key"],
                                                "properties": {
                                                    "name": {"type": "string"},
                                                    "key": {"type": "string"},
                                                },
                                            }
                                        },
                                    },
                                    "serverName": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


# --- rendering ---------------------------------------------------------------------------------


def _generated_config_map(directory: Path, generator: Doc) -> Doc:
    data: dict[str, str] = {}
    for literal in generator.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    for entry in generator.get("files", []):
        key, _, source = entry.rpartition("=")
        path = directory / source
        data[key or path.name] = path.read_text()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": generator["name"]},
        "data": data,
    }


def _containers(doc: Doc) -> Iterator[Doc]:
    if doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}:
        spec = doc["spec"]["template"]["spec"]
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def render_from_files(directory: Path) -> list[Doc]:
    """kustomize's resources, configMapGenerator, namespace and images, done by hand."""
    kustomization = load_docs(directory / "kustomization.yaml")[0]
    docs: list[Doc] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs.extend(render_from_files(path) if path.is_dir() else load_docs(path))
    docs.extend(
        _generated_config_map(directory, g) for g in kustomization.get("configMapGenerator", [])
    )
    docs = copy.deepcopy(docs)
    if namespace := kustomization.get("namespace"):
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    new_name = image.get("newName", name)
                    suffix = (
                        f"@{image['digest']}"
                        if "digest" in image
                        else f":{image.get('newTag', tag)}"
                    )
                    container["image"] = new_name + suffix
    return docs


@cache
def _kubectl_render(directory: Path) -> str:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def render_with_kustomize(directory: Path) -> list[Doc]:
    return parse_docs(_kubectl_render(directory))


RENDERERS: dict[str, Callable[[Path], list[Doc]]] = {
    "files": render_from_files,
    "kustomize": render_with_kustomize,
}


@pytest.fixture(
    params=[(renderer, overlay) for renderer in RENDERERS for overlay in OVERLAYS],
    ids=lambda p: f"{p[0]}-{p[1].name}",
)
def rendered(request: pytest.FixtureRequest) -> list[Doc]:
    renderer, overlay = request.param
    return RENDERERS[renderer](overlay)


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def config_map(docs: list[Doc], name: str) -> Doc:
    """A ConfigMap by its generator name (kustomize appends a content hash)."""
    found = [
        d
        for d in docs
        if d["kind"] == "ConfigMap"
        and re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", d["metadata"]["name"])
    ]
    assert len(found) == 1, name
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def pod_spec(deployment: Doc) -> Doc:
    spec: Doc = deployment["spec"]["template"]["spec"]
    return spec


def container(deployment: Doc, name: str) -> Doc:
    return next(c for c in pod_spec(deployment)["containers"] if c["name"] == name)


def server(docs: list[Doc]) -> Doc:
    return one(docs, "Deployment", "cryptd")


def redis(docs: list[Doc]) -> Doc:
    return one(docs, "Deployment", "cryptd-redis")


# --- files, lint, schemas ----------------------------------------------------------------------


def test_there_is_something_to_check() -> None:
    assert {p.name for p in KUSTOMIZATIONS} >= {"base", "redis", "production"}
    assert len(MANIFESTS) >= 12


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_file_a_kustomization_names_exists_and_parses(directory: Path) -> None:
    kustomization = load_docs(directory / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization"
    for resource in kustomization.get("resources", []):
        path = directory / resource
        assert path.exists(), f"{directory}: {resource} missing"
        if path.is_dir():
            assert (path / "kustomization.yaml").is_file(), f"{resource} is no kustomization"
        else:
            assert load_docs(path), f"{resource} is empty"
    for generator in kustomization.get("configMapGenerator", []):
        for entry in generator.get("files", []):
            assert (directory / entry.rpartition("=")[2]).is_file(), entry
    listed = {directory / r for r in kustomization.get("resources", [])}
    unlisted = {p for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"} - listed
    assert not unlisted, f"files no kustomization uses: {sorted(map(str, unlisted))}"


@pytest.mark.slow
def test_yamllint_is_clean() -> None:
    targets = [str(K8S / d) for d in ("base", "redis", "overlays")] + [str(ROOT / ".yamllint")]
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-c", str(ROOT / ".yamllint"), *targets],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.slow
def test_yamllint_config_catches_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("key: yes\nmode: 0440\nlist:\n- a\n-   b \n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "yamllint",
            "-f",
            "parsable",
            "-c",
            str(ROOT / ".yamllint"),
            str(bad),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    for rule in ("document-start", "truthy", "octal-values", "trailing-spaces"):
        assert f"({rule})" in result.stdout


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            _closed(value)
    elif isinstance(schema, list):
        for value in schema:
            _closed(value)
    return schema


@functools.cache
def cert_manager_schema(kind: str) -> dict[str, Any]:
    """cert-manager's v1 CRD schema for ``kind``, as the cloudcoil-models-cert-manager package
    generates it from cert-manager's published CRDs (its models; their JSON schema), closed so
    that a misspelled field fails. kubernetes-validate has no CRDs."""
    from cloudcoil.models.cert_manager import v1  # type: ignore[import-not-found,unused-ignore]

    model = getattr(v1, kind)
    schema: dict[str, Any] = _closed(model.model_json_schema(by_alias=True, mode="validation"))
    return schema


def _validate(doc: Doc, version: str) -> None:
    if doc["kind"] == "ServiceMonitor":
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        return
    if doc["apiVersion"] == "cert-manager.io/v1":
        jsonschema.validate(doc, cert_manager_schema(doc["kind"]))
        return
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_matches_the_kubernetes_schema(path: Path, version: str) -> None:
    for doc in load_docs(path):
        _validate(doc, version)


@pytest.mark.slow
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_kustomize_output_matches_the_kubernetes_schema(directory: Path, version: str) -> None:
    docs = render_with_kustomize(directory)
    assert docs
    for doc in docs:
        _validate(doc, version)


@pytest.mark.slow
def test_schema_validation_rejects_mistakes() -> None:
    deployment = server(render_from_files(OVERLAYS[0]))
    typo = copy.deepcopy(deployment)
    container(typo, "cryptd")["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSIONS[0], strict=True)
    wrong_type = copy.deepcopy(deployment)
    container(wrong_type, "cryptd")["ports"][0]["containerPort"] = "8080"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, K8S_VERSIONS[0], strict=True)
    monitor = one(load_docs(K8S / "base" / "servicemonitor.yaml"), "ServiceMonitor")
    broken = copy.deepcopy(monitor)
    broken["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)
    broken = copy.deepcopy(monitor)
    broken["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)
    certificate = one(load_docs(K8S / "base" / "certificate.yaml"), "Certificate", "cryptd-tls")
    mutations: tuple[Callable[[dict[str, Any]], object], ...] = (
        lambda c: c["spec"].update(dnsName=["cryptd"]),  # misspelled field
        lambda c: c["spec"]["privateKey"].update(algorithm="ECDSAX"),  # not an algorithm
        lambda c: c["spec"]["privateKey"].update(size="256"),  # wrong type
        lambda c: c["spec"]["usages"].append("server-auth"),  # not a usage
        lambda c: c["spec"].pop("issuerRef"),  # required
    )
    for mutate in mutations:
        broken = copy.deepcopy(certificate)
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, cert_manager_schema("Certificate"))


def test_renderings_agree_on_the_resources() -> None:
    for overlay in OVERLAYS:
        by_files = {(d["kind"], d["metadata"]["name"]) for d in render_from_files(overlay)}
        by_kustomize = {
            (
                d["kind"],
                re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"])
                if d["kind"] == "ConfigMap"
                else d["metadata"]["name"],
            )
            for d in render_with_kustomize(overlay)
        }
        assert by_files == by_kustomize


# --- cross-references --------------------------------------------------------------------------


def test_deployments_select_their_own_pods(rendered: list[Doc]) -> None:
    for deployment in (server(rendered), redis(rendered)):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"]["matchLabels"], labels)


def test_services_select_the_pods_and_name_their_ports(rendered: list[Doc]) -> None:
    for name, deployment, container_name in (
        ("cryptd", server(rendered), "cryptd"),
        ("cryptd-redis", redis(rendered), "redis"),
    ):
        service = one(rendered, "Service", name)
        assert selects(
            service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
        )
        port_names = {p["name"] for p in container(deployment, container_name)["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names


def test_hpa_and_pdb_target_the_server(rendered: list[Doc]) -> None:
    deployment = server(rendered)
    hpa = one(rendered, "HorizontalPodAutoscaler", "cryptd")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "cryptd",
    }
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource"
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    # Utilization is measured against the request, so the request must exist.
    assert container(deployment, "cryptd")["resources"]["requests"]["cpu"]
    # The HPA owns the replica count; a count in the manifest would reset it on every apply.
    assert "replicas" not in deployment["spec"]
    pdb = one(rendered, "PodDisruptionBudget", "cryptd")
    assert pdb["apiVersion"] == "policy/v1"
    assert selects(
        pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert pdb["spec"].get("maxUnavailable", 0) == 1
    assert "minAvailable" not in pdb["spec"]


def test_service_monitor_scrapes_the_service(rendered: list[Doc]) -> None:
    monitor = one(rendered, "ServiceMonitor", "cryptd")
    service = one(rendered, "Service", "cryptd")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics"


def test_volumes_and_mounts_line_up(rendered: list[Doc]) -> None:
    for deployment in (server(rendered), redis(rendered)):
        volumes = {v["name"] for v in pod_spec(deployment)["volumes"]}
        mounted = {m["name"] for c in _containers(deployment) for m in c.get("volumeMounts", [])}
        assert mounted == volumes, deployment["metadata"]["name"]


def test_every_config_map_referenced_is_produced(rendered: list[Doc]) -> None:
    produced = {d["metadata"]["name"] for d in rendered if d["kind"] == "ConfigMap"}
    for deployment in (server(rendered), redis(rendered)):
        spec = pod_spec(deployment)
        referenced = {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
        for c in _containers(deployment):
            referenced |= {
                e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e
            }
        assert referenced <= produced


def _secret_references(docs: list[Doc]) -> dict[str, set[str]]:
    """Secret name -> keys the pods read (an empty set: the whole Secret is mounted)."""
    refs: dict[str, set[str]] = {}
    for deployment in (server(docs), redis(docs)):
        for volume in pod_spec(deployment)["volumes"]:
            if "secret" in volume:
                keys = {item["key"] for item in volume["secret"].get("items", [])}
                refs.setdefault(volume["secret"]["secretName"], set()).update(keys)
        for c in _containers(deployment):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(ref["name"], set()).add(ref["key"])
    return refs


@cache
def secrets_from_script() -> dict[str, set[str]]:
    """Run k8s/scripts/make-secrets.sh on throwaway inputs: Secret name -> its keys."""
    import base64
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "master.key").write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
        (work / "keyring.json").write_text('{"keys": {}}')
        (work / "clients.json").write_text('{"clients": {}}')
        from service.edge.devcerts import issue, make_ca

        ca = make_ca("make-secrets test CA")
        leaf = issue(ca, ["cryptd.cryptd.svc"])
        (work / "tls.crt").write_bytes(leaf.cert_pem())
        (work / "tls.key").write_bytes(leaf.key_pem())
        (work / "ca.crt").write_bytes(ca.cert_pem())
        result = subprocess.run(
            [
                str(K8S / "scripts" / "make-secrets.sh"),
                "--master-key",
                str(work / "master.key"),
                "--keyring",
                str(work / "keyring.json"),
                "--clients",
                str(work / "clients.json"),
                "--redis-password-file",
                str(work / "redis-password"),
                # The plain-Secret alternative to cert-manager's cryptd-tls.
                "--tls-cert",
                str(work / "tls.crt"),
                "--tls-key",
                str(work / "tls.key"),
                "--tls-ca",
                str(work / "ca.crt"),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PATH": f"{Path(tool('kubectl')).parent}:{os.environ['PATH']}"},
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    return {
        d["metadata"]["name"]: set(d["data"])
        for d in parse_docs(result.stdout)
        if d["kind"] == "Secret"
    }


def test_every_secret_referenced_is_built_by_the_script_and_documented(rendered: list[Doc]) -> None:
    # Secrets are never in the manifests: make-secrets.sh builds them (cert-manager too, for
    # its Certificates) and DEPLOY.md names them.
    assert not [d for d in rendered if d["kind"] == "Secret"]
    built = secrets_from_script()
    for certificate in (d for d in rendered if d["kind"] == "Certificate"):
        issued = certificate["spec"]["secretName"]
        if issued in built:
            assert built[issued] == {"tls.crt", "tls.key", "ca.crt"}  # cert-manager's keys
    deploy_doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    for name, keys in _secret_references(rendered).items():
        assert name in built, f"make-secrets.sh does not build {name}"
        assert keys <= built[name], (name, keys - built[name])
        assert f"`{name}`" in deploy_doc, f"docs/DEPLOY.md does not mention {name}"


def test_configured_files_live_on_the_mounted_secrets(rendered: list[Doc]) -> None:
    deployment = server(rendered)
    settings = config_map(rendered, "cryptd-config")["data"]
    mounts = {m["mountPath"]: m["name"] for m in container(deployment, "cryptd")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    built = secrets_from_script()
    for variable in ("CRYPTD_MASTER_KEY_FILE", "CRYPTD_KEYRING_FILE", "CRYPTD_CLIENTS_FILE"):
        path = Path(settings[variable])
        volume = volumes[mounts[str(path.parent)]]
        secret_name = volume["secret"]["secretName"]
        assert path.name in built[secret_name], (variable, secret_name)
    for variable in ("TMPDIR", "PROMETHEUS_MULTIPROC_DIR"):
        assert "emptyDir" in volumes[mounts[settings[variable]]], variable


def test_config_map_names_only_real_settings() -> None:
    from service.config import Settings

    fields = {f"CRYPTD_{name.upper()}" for name in Settings.model_fields}
    docs = render_from_files(OVERLAYS[0])
    data = config_map(docs, "cryptd-config")["data"]
    unknown = {k for k in data if k.startswith("CRYPTD_")} - fields
    assert not unknown, f"not cryptd settings: {unknown}"
    assert set(data) - fields <= {"PROMETHEUS_MULTIPROC_DIR", "TMPDIR"}


def test_config_map_is_a_valid_production_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.config import Settings

    docs = render_from_files(OVERLAYS[0])
    for name, value in config_map(docs, "cryptd-config")["data"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CRYPTD_REDIS_URL", "redis://cryptd:x@cryptd-redis:6379/0")
    monkeypatch.delenv("CRYPTD_MASTER_KEY", raising=False)
    settings = Settings()
    assert settings.env == "production"
    assert settings.keyring_read_only is True
    assert settings.port == 8080
    assert settings.host == "0.0.0.0"


# --- network policy ----------------------------------------------------------------------------


def _policy(docs: list[Doc], name: str) -> Doc:
    return one(docs, "NetworkPolicy", name)


def test_server_ingress_only_from_client_namespaces_and_prometheus(rendered: list[Doc]) -> None:
    policy = _policy(rendered, "cryptd")
    spec = policy["spec"]
    assert selects(
        spec["podSelector"]["matchLabels"],
        server(rendered)["spec"]["template"]["metadata"]["labels"],
    )
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    peers = []
    for rule in spec["ingress"]:
        assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
        assert rule["from"], "an empty 'from' admits everyone"
        peers.extend(rule["from"])
    for peer in peers:
        assert "ipBlock" not in peer
        assert peer["namespaceSelector"]["matchLabels"]  # never "all namespaces"
    assert {"namespaceSelector": {"matchLabels": {"cryptd-client": "true"}}} in peers
    prometheus = [p for p in peers if "podSelector" in p]
    assert prometheus == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]


def test_server_egress_only_to_redis_and_dns(rendered: list[Doc]) -> None:
    spec = _policy(rendered, "cryptd")["spec"]
    redis_labels = redis(rendered)["spec"]["template"]["metadata"]["labels"]
    redis_port = container(redis(rendered), "redis")["ports"][0]["containerPort"]
    destinations = []
    for rule in spec["egress"]:
        assert rule["to"], "an empty 'to' allows every destination"
        for peer in rule["to"]:
            assert "ipBlock" not in peer
            ports = {(p["protocol"], p["port"]) for p in rule["ports"]}
            if "namespaceSelector" in peer:
                assert peer == {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                    },
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                }
                assert ports == {("UDP", 53), ("TCP", 53)}
                destinations.append("dns")
            else:
                assert selects(peer["podSelector"]["matchLabels"], redis_labels)
                assert ports == {("TCP", redis_port)}
                destinations.append("redis")
    assert sorted(destinations) == ["dns", "redis"]


def test_redis_admits_only_cryptd_and_calls_nobody(rendered: list[Doc]) -> None:
    spec = _policy(rendered, "cryptd-redis")["spec"]
    assert selects(
        spec["podSelector"]["matchLabels"],
        redis(rendered)["spec"]["template"]["metadata"]["labels"],
    )
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    assert spec["egress"] == []
    [rule] = spec["ingress"]
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only
    assert selects(
        peer["podSelector"]["matchLabels"],
        server(rendered)["spec"]["template"]["metadata"]["labels"],
    )
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


def test_overlay_denies_everything_else_in_the_namespace(rendered: list[Doc]) -> None:
    deny = _policy(rendered, "default-deny-all")["spec"]
    assert deny["podSelector"] == {}
    assert set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny
    assert "egress" not in deny


# --- security review ---------------------------------------------------------------------------


def _workloads(docs: list[Doc]) -> list[Doc]:
    found = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}]
    assert len(found) == 2
    return found


def test_pods_run_as_non_root_with_runtime_default_seccomp(rendered: list[Doc]) -> None:
    for workload in _workloads(rendered):
        pod = pod_spec(workload)["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] > 0
        assert pod["runAsGroup"] > 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod_spec(workload).get(key)


def test_containers_are_locked_down(rendered: list[Doc]) -> None:
    for workload in _workloads(rendered):
        for c in _containers(workload):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["privileged"] is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]


def test_no_service_account_token_and_no_service_links(rendered: list[Doc]) -> None:
    for workload in _workloads(rendered):
        spec = pod_spec(workload)
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False
        account = one(rendered, "ServiceAccount", spec["serviceAccountName"])
        assert account["automountServiceAccountToken"] is False


def _quantity(value: str | int) -> float:
    text = str(value)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_resources_have_requests_and_limits(rendered: list[Doc]) -> None:
    for workload in _workloads(rendered):
        for c in _containers(workload):
            resources = c["resources"]
            for resource in ("cpu", "memory"):
                request = _quantity(resources["requests"][resource])
                limit = _quantity(resources["limits"][resource])
                assert 0 < request <= limit, (c["name"], resource)


def test_server_probes(rendered: list[Doc]) -> None:
    c = container(server(rendered), "cryptd")
    named_ports = {p["name"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in named_ports
    redis_container = container(redis(rendered), "redis")
    assert redis_container["readinessProbe"]
    assert redis_container["livenessProbe"]


def _drain_bound() -> int:
    serve = ROOT / "service" / "cli" / "serve.py"
    found = (
        re.search(r"timeout_graceful_shutdown=(\d+)", serve.read_text()) if serve.exists() else None
    )
    return int(found.group(1)) if found else PREFERRED_DRAIN_BOUND


def test_termination_lets_in_flight_requests_drain(rendered: list[Doc]) -> None:
    deployment = server(rendered)
    c = container(deployment, "cryptd")
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = int(command[1])
    assert pre_stop >= 5
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert grace > pre_stop + _drain_bound(), "SIGKILL would cut the drain short"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_secrets_are_mounted_read_only_whole_never_by_sub_path(rendered: list[Doc]) -> None:
    # The kubelet never updates a subPath mount, and hot reload of the keyring relies on it.
    for workload in _workloads(rendered):
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        for c in _containers(workload):
            for mount in c.get("volumeMounts", []):
                assert "subPath" not in mount
                assert "subPathExpr" not in mount
                volume = volumes[mount["name"]]
                if "secret" in volume or "configMap" in volume:
                    assert mount["readOnly"] is True
                if "secret" in volume:
                    assert volume["secret"]["defaultMode"] & 0o007 == 0, "world-readable secret"
                    assert volume["secret"].get("optional") is not True
                assert "hostPath" not in volume


def test_writable_paths_are_bounded_empty_dirs(rendered: list[Doc]) -> None:
    for workload in _workloads(rendered):
        for volume in pod_spec(workload)["volumes"]:
            if "emptyDir" in volume:
                assert volume["emptyDir"]["sizeLimit"], volume["name"]


def test_images_are_pinned(rendered: list[Doc]) -> None:
    for workload in _workloads(rendered):
        for c in _containers(workload):
            image = c["image"]
            assert not image.endswith(":latest")
            assert re.search(
                r":[\w][\w.-]*(@sha256:[0-9a-f]{64})?$|@sha256:[0-9a-f]{64}$", image
            ), image
    assert re.search(r"@sha256:[0-9a-f]{64}$", container(redis(rendered), "redis")["image"])


def test_everything_is_labelled_and_namespaced(rendered: list[Doc]) -> None:
    namespaces = {
        d["metadata"].get("namespace") for d in rendered if d["kind"] not in CLUSTER_SCOPED
    }
    assert len(namespaces) == 1
    assert None not in namespaces
    for doc in rendered:
        if doc["kind"] != "ConfigMap":
            assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "cryptd", doc[
                "metadata"
            ]["name"]


def test_namespace_enforces_the_restricted_pod_security_standard(rendered: list[Doc]) -> None:
    namespace = one(rendered, "Namespace")
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {d["metadata"]["namespace"] for d in rendered if d["kind"] == "Deployment"} == {
        namespace["metadata"]["name"]
    }


def test_kustomize_applies_the_overlay_patches() -> None:
    for overlay in OVERLAYS:
        docs = render_with_kustomize(overlay)
        assert one(docs, "ServiceMonitor", "cryptd")["metadata"]["labels"]["release"]
        base_max = one(render_with_kustomize(K8S / "base"), "HorizontalPodAutoscaler")["spec"][
            "maxReplicas"
        ]
        assert one(docs, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] >= base_max
        # The generated ConfigMap's hashed name is what the Deployment refers to.
        generated = config_map(docs, "cryptd-config")["metadata"]["name"]
        env_from = container(server(docs), "cryptd")["envFrom"]
        assert {"configMapRef": {"name": generated}} in env_from
        assert generated != "cryptd-config"
