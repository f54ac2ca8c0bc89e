"""The alert rules with Prometheus's own tool: `promtool check rules` and `promtool test rules`
(shared/obs/deploy/bundle-rules.test.yml: the TTFT alert against the exported objective and the
rules' 500 ms default, and the KV-cache, engine-death and 5xx alerts). The live check of every
expression against a real server is tests/test_observability.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.observability_assets import (
    DASHBOARD,
    RULES,
    RULES_TEST,
    alert_expressions,
    dashboard_queries,
    with_bool_comparisons,
)
from tests.prometheus_server import binary


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_expressions())} rules found" in done.stdout


def test_promtool_unit_tests_pass() -> None:
    done = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_unit_tests_fail_when_the_ttft_rule_ignores_the_objective(tmp_path: Path) -> None:
    """The unit tests can fail: with the TTFT alert's objective fixed at 0.5 s, the deploy whose
    objective is 1 s would be paged, and its test says it must not be."""
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    text = RULES.read_text()
    fixed = text.replace("> (max(bundle_ttft_sla_seconds) or vector(0.5))", "> 0.5")
    assert fixed != text
    (tmp_path / RULES.name).write_text(fixed)
    done = promtool("test", "rules", RULES_TEST.name, cwd=tmp_path)
    assert done.returncode != 0
    assert "BundleTTFTP99OverSLA" in done.stdout + done.stderr


def test_every_alert_compares_with_spaces_around_the_operator() -> None:
    """What lets the live test see each alert's operands return data (`> bool`)."""
    for name, expr in alert_expressions().items():
        assert with_bool_comparisons(expr) != expr, name
    assert set(alert_expressions()) == {
        "BundleTTFTP99OverSLA",
        "BundleQueueGrowing",
        "BundleKVCacheNearlyFull",
        "BundleStoreErrors",
        "BundleEngineDied",
        "BundleTakeovers",
        "Bundle5xxRate",
    }


def test_the_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {item["name"]: item for item in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert len(dashboard["panels"]) >= 10
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
    assert len(dashboard_queries("1m")) > len(dashboard["panels"])
