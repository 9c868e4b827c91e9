"""The shipped monitoring files: Prometheus alert rules and a Grafana dashboard (monitoring/).

Every expression may name only metrics the package exports (:class:`OutboxCollector`'s gauges
and ``track_deliveries``' counter): a renamed gauge fails here, not silently in an operator's
Prometheus. The rules are checked by ``promtool check rules`` and their unit tests
(``monitoring/outbox-alerts.test.yml``: each alert fires on the series that should fire it and
not on the others) by ``promtool test rules``; where promtool is not installed those two tests
skip and the structure is still checked by the parser below (.ci/run installs promtool).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox_celery.ops.metrics import OutboxCollector

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "outbox-alerts.yml"
RULE_TESTS = ROOT / "monitoring" / "outbox-alerts.test.yml"
DASHBOARD = ROOT / "monitoring" / "outbox-dashboard.json"

# PromQL words that are not metric names (aggregations, functions, keywords).
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "sum", "max", "min", "avg", "count", "rate", "increase", "delta",
    "absent", "topk", "bottomk", "histogram_quantile", "time", "vector", "clamp_min",
}  # fmt: skip
# What the issue asks the rules to watch, by the gauge each alert reads.
WATCHED = {
    "outbox_oldest_ready_wait_seconds",  # oldest ready age / the claim stopped
    "outbox_messages",  # dead growth
    "outbox_headless_keys",  # keys without a head
    "outbox_xmin_horizon_age_seconds",  # the horizon held
}


def exported() -> set[str]:
    """Every metric name the package exports (with the default namespace)."""
    collector = OutboxCollector("postgresql://unused@127.0.0.1/unused", handlers=set())
    names = {family.name for family in collector.describe()}
    source = (ROOT / "outbox_celery" / "app" / "metrics.py").read_text(encoding="utf-8")
    assert 'f"{namespace}_deliveries"' in source  # track_deliveries' counter, exposed with _total
    return names | {"outbox_deliveries_total"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, grouping and ranges removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\boffset\s+\w+", "", text)
    words = re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\b(?!\s*\()", text)
    return {w for w in words if w not in PROMQL_WORDS}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert isinstance(doc, dict) and list(doc) == ["groups"], doc
    rules = []
    for group in doc["groups"]:
        assert set(group) == {"name", "rules"}, group
        rules += group["rules"]
    return rules


def test_the_metric_name_parser_finds_names_and_only_names() -> None:
    expr = 'max by (table, kind) (rate(outbox_x{status="a b"}[5m] offset 1h)) - on(table) outbox_y > 3'
    assert metric_names(expr) == {"outbox_x", "outbox_y"}


def test_the_alert_rules_parse_and_read_only_exported_metrics() -> None:
    rules = _rules()
    names = exported()
    alerts = [r["alert"] for r in rules]
    assert len(alerts) == len(set(alerts)), alerts
    read: set[str] = set()
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"Outbox[A-Za-z]+", rule["alert"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
        used = metric_names(rule["expr"])
        assert used, rule["expr"]
        assert used <= names, f"{rule['alert']} reads {sorted(used - names)}, not exported by metrics.py"
        read |= used
    assert read >= WATCHED, sorted(WATCHED - read)


def test_the_dashboard_parses_and_reads_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] == "outbox-celery"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "table"}
    names = exported()
    read: set[str] = set()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'table=~"$table"' in target["expr"], target["expr"]
            used = metric_names(target["expr"])
            assert used and used <= names, f"{panel['title']}: {sorted(used - names)} not exported"
            read |= used
    assert read >= WATCHED, sorted(WATCHED - read)


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    return found


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout, done.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    done = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
