"""The Grafana dashboards tests/e2e/test_dashboards.py checks on a real Prometheus are the ones
docker-compose.yml provisions: compose mounts observability/grafana/dashboards where the provisioning file
points, and every panel reads the Prometheus datasource that compose provisions, by its uid."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.e2e.prometheus import GRAFANA, dashboard_queries, dashboards_dir

ROOT = Path(__file__).resolve().parents[2]


def grafana_mounts() -> dict[str, str]:
    """Container path → repository path (relative, as compose writes it) of the grafana service's mounts."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = {}
    for volume in compose["services"]["grafana"]["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


def test_compose_provisions_the_dashboards_folder_the_tests_read() -> None:
    mounts = grafana_mounts()
    provider_file = next(t for t, s in mounts.items() if s == "./observability/grafana/dashboards.yaml")
    assert provider_file.startswith("/etc/grafana/provisioning/dashboards/")
    providers = yaml.safe_load((GRAFANA / "dashboards.yaml").read_text())["providers"]
    folder = providers[0]["options"]["path"]
    assert (ROOT / mounts[folder]).resolve() == dashboards_dir().resolve()
    assert any(t.startswith("/etc/grafana/provisioning/datasources/") for t in mounts)


def test_every_panel_reads_the_provisioned_prometheus() -> None:
    sources = yaml.safe_load((GRAFANA / "datasources.yaml").read_text())["datasources"]
    prometheus_uid = next(s["uid"] for s in sources if s["type"] == "prometheus")
    dashboards = sorted(dashboards_dir().glob("*.json"))
    assert dashboards
    for path in dashboards:
        dash = json.loads(path.read_text())
        assert dash["uid"] and dash["title"]
        for panel in dash["panels"]:
            assert panel["datasource"]["uid"] == prometheus_uid, panel["title"]
            assert panel["targets"], panel["title"]
            for t in panel["targets"]:
                assert t["datasource"]["uid"] == prometheus_uid and "pdserve:" in t["expr"], panel["title"]
    assert len(dashboard_queries()) >= 12
