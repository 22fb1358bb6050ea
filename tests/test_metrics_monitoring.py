"""k8s/monitoring: the dashboard and the alert rules parse, and every PromQL expression in them
is valid and names only metrics, labels and quantiles that cryptd exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import Metrics, certificate

MONITORING = Path(__file__).resolve().parents[1] / "k8s" / "monitoring"
# Labels Prometheus adds to every scraped series (ServiceMonitor target labels).
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "endpoint", "container"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*", "$route": ".*"}


@cache
def exported() -> dict[str, set[str]]:
    """Every sample name cryptd exports, with its label names: a Metrics after one call of
    each recording method, rendered and parsed as Prometheus would."""
    metrics = Metrics()
    metrics.observe_request("/v1/encrypt/{key}", "POST", 200, 0.0004)
    metrics.observe_crypto("encrypt", "aes256-gcm", 0.00002)
    metrics.auth_failure("bad_signature")
    metrics.rejected("overload")
    metrics.pool_gauges(1, 1, max_pending=8)
    metrics.queue_wait(0.001)
    metrics.keyring_reload(True)
    metrics.key_change_propagated(0.01, complete=False)
    metrics.store_up("replay", True)
    metrics.clock_offset("replay", -0.01)
    metrics.clock_offset("keystore", -0.02)
    metrics.audit_write_failures(1)
    certificate.served(time.time() + 86400)  # as a server serving TLS does
    try:
        body = metrics.render()[0].decode()
    finally:
        certificate.served(None)
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def exported_quantiles() -> set[str]:
    metrics = Metrics()
    metrics.observe_request("/v1/encrypt/{key}", "POST", 200, 0.0004)
    body = metrics.render()[0].decode()
    return set(re.findall(r'quantile="([^"]+)"', body))


def load_rules() -> dict[str, Any]:
    document = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert isinstance(document, dict)
    return document


def load_dashboard() -> dict[str, Any]:
    document = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert isinstance(document, dict)
    return document


def recorded_names() -> set[str]:
    return {
        rule["record"]
        for group in load_rules()["spec"]["groups"]
        for rule in group["rules"]
        if "record" in rule
    }


def rule_expressions() -> list[str]:
    return [
        str(rule["expr"]) for group in load_rules()["spec"]["groups"] for rule in group["rules"]
    ]


def dashboard_expressions() -> list[str]:
    expressions = []
    for panel in load_dashboard()["panels"]:
        for target in panel.get("targets", []):
            expression = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expression = expression.replace(variable, value)
            expressions.append(expression)
    return expressions


def walk(node: Any) -> Iterator[Any]:
    yield node
    for attribute in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None and not isinstance(child, str | int | float):
            yield from walk(child)
    for child in getattr(node, "args", None) or []:
        yield from walk(child)


def check_expression(expression: str) -> None:
    """Parses, selects only known series, and groups or matches only by labels they carry."""
    names = exported()
    recorded = recorded_names()
    tree = promql_parser.parse(expression)
    selected_labels: set[str] = set(TARGET_LABELS)
    for node in walk(tree):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name in names or node.name in recorded, f"{node.name} is not exported"
            carried = names.get(node.name, set()) | {"le"} if node.name else set()
            selected_labels |= carried
            for matcher in node.matchers.matchers:
                assert matcher.name in carried | TARGET_LABELS, (node.name, matcher.name)
                if matcher.name == "quantile":
                    assert matcher.value in exported_quantiles(), matcher.value
    for node in walk(tree):
        modifier = getattr(node, "modifier", None)
        grouping = getattr(modifier, "matching", modifier)
        for label in getattr(grouping, "labels", None) or []:
            assert label in selected_labels | {"route", "namespace"}, (expression, label)


def test_rule_file_is_a_prometheus_operator_rule() -> None:
    rules = load_rules()
    assert rules["apiVersion"] == "monitoring.coreos.com/v1"
    assert rules["kind"] == "PrometheusRule"
    assert rules["metadata"]["name"] == "cryptd"
    alerts = {
        rule["alert"]: rule
        for group in rules["spec"]["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    for name in (
        "CryptdLatencyP99High",
        "CryptdErrorRatioHigh",
        "CryptdWorkQueueSaturated",
        "CryptdAuthFailureSpike",
        "CryptdCertificateExpiresSoon",
        "CryptdReplayStoreUnavailable",
        "CryptdKeyStoreUnavailable",
        "CryptdAuditWriteFailures",
    ):
        assert name in alerts
    for rule in alerts.values():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
        assert re.fullmatch(r"\d+[smh]", rule["for"])


@pytest.mark.parametrize("expression", rule_expressions())
def test_rule_expressions_are_valid_and_use_exported_metrics(expression: str) -> None:
    check_expression(expression)


@pytest.mark.parametrize("expression", dashboard_expressions())
def test_dashboard_expressions_are_valid_and_use_exported_metrics(expression: str) -> None:
    check_expression(expression)


def test_dashboard_layout_is_sound() -> None:
    dashboard = load_dashboard()
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "cryptd-overview"
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "namespace"}
    for panel in panels:
        position = panel["gridPos"]
        assert position["x"] >= 0
        assert position["x"] + position["w"] <= 24
        if panel["type"] != "row":
            refs = [target["refId"] for target in panel["targets"]]
            assert refs
            assert len(refs) == len(set(refs))
            assert panel["datasource"]["uid"] == "${datasource}"
    titles = " ".join(panel["title"].lower() for panel in panels)
    for topic in ("request rate", "error ratio", "p50 / p99", "histogram_quantile", "operations",
                  "saturation", "authentication failures", "rejections"):  # fmt: skip
        assert topic in titles, topic


def test_every_exported_family_appears_on_the_dashboard() -> None:
    used = " ".join(dashboard_expressions())
    families = {re.sub(r"_(bucket|count|sum|total)$", "", name) for name in exported()}
    families -= {"cryptd_latency_window_seconds"}  # a constant, shown in the descriptions
    missing = {family for family in families if family not in used}
    assert not missing


def test_the_checker_refuses_unknown_metrics_and_labels() -> None:
    with pytest.raises(AssertionError, match="not exported"):
        check_expression("rate(cryptd_no_such_metric_total[5m])")
    with pytest.raises(AssertionError):
        check_expression('cryptd_rejections_total{reason="overload"}')
    with pytest.raises(AssertionError):
        check_expression('cryptd_http_request_duration_window_seconds{quantile="0.95"}')
    with pytest.raises(ValueError):  # noqa: PT011 - the parser's own error type
        promql_parser.parse("sum(rate(cryptd_rejections_total[5m])")


def test_yamllint_is_clean() -> None:
    root = MONITORING.parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-c", str(root / ".yamllint"),
         str(MONITORING)],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout


def test_kustomization_ships_rules_and_dashboard() -> None:
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["prometheusrule.yaml"]
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == ["grafana-dashboard.json"]
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
