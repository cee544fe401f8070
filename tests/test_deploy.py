"""Structural checks of deploy/ and the Dockerfile (pure Python, no cluster, no daemon).

The real validators (systemd-analyze, kubernetes-validate, promtool, hadolint, ...) run in
scripts/validate-deploy.sh; `test_validate_deploy_script` runs it when
KVX_VALIDATE_DEPLOY=1.  Names checked here come from docs/contracts.md (metrics) and the
generated docs/config.md (config keys), so a renamed metric or config key fails these tests instead of silently breaking a dashboard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CONTRACTS = ROOT / "docs" / "contracts.md"
CONFIG_DOC = ROOT / "docs" / "config.md"  # generated from kvxferd/config.py
UNIT = DEPLOY / "systemd" / "kvxferd.service"
EXAMPLE_TOML = DEPLOY / "systemd" / "kvxferd.toml"
K8S = DEPLOY / "kubernetes"
PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "kvxferd-dashboard.json"
DOCKERFILE = ROOT / "Dockerfile"

PEER_PORT = 7471
PEER_STREAM_PORT = 7472
METRICS_PORT = 9479
SOCKET_DIR = "/run/kvxferd"
SOCKET = f"{SOCKET_DIR}/kvxferd.sock"
# Environment variables of the fixed CLI (docs/contracts.md, ARCHITECTURE "Operator interface").
CLI_ENV = {"KVXFERD_CONFIG", "KVXFERD_SOCKET", "KVXFERD_LISTEN", "KVXFERD_METRICS_PORT"}


# --------------------------------------------------------------------------- contracts


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/contracts.md has no '## {title}' section"
    return m.group(1)


def contract_metrics() -> tuple[set[str], set[str]]:
    """(all metric names, histogram names) from contracts.md '## Metric names'."""
    sec = _section(CONTRACTS.read_text(), "Metric names")
    names: set[str] = set()
    histograms: set[str] = set()
    for line in sec.splitlines():
        found = re.findall(r"\b(kvxferd_[a-z0-9_]+)", line)
        names.update(found)
        if "histogram" in line:
            histograms.update(found)
    assert len(names) >= 10, names
    return names, histograms


def contract_config() -> tuple[set[str], dict[str, str]]:
    """(config keys, {key: default text}) from the generated reference docs/config.md's key table."""
    defaults = {m.group(1): m.group(2).strip().strip("`")
                for m in re.finditer(r"^\| \[`([a-z_][a-z0-9_]*)`\]\(#[a-z0-9_]+\) \| (.*) \|$",
                                     CONFIG_DOC.read_text(), re.M)}
    keys = set(defaults)
    assert {"socket", "peer_listen", "metrics_port", "drain_grace_s"} <= keys, keys
    return keys, defaults


def drain_grace_default() -> float:
    _, defaults = contract_config()
    return float(re.match(r"[\d.]+", defaults["drain_grace_s"]).group(0))


def allowed_env() -> set[str]:
    keys, _ = contract_config()
    return CLI_ENV | {f"KVXFERD_{k.upper()}" for k in keys}


def allowed_series(extra: set[str] = frozenset()) -> set[str]:
    names, hist = contract_metrics()
    series = set(names) | set(extra)
    for h in hist:
        series |= {f"{h}_bucket", f"{h}_count", f"{h}_sum"}
    return series


# --------------------------------------------------------------------------- PromQL

_PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
    "start",
    "end",
    "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (Grafana $variables tolerated)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges / subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)", s):
        tok = m.group(1)
        if s[m.end() :].lstrip().startswith("("):
            continue  # function or aggregation
        if tok.lower() in _PROMQL_KEYWORDS:
            continue
        names.add(tok)
    return names


def test_promql_metric_names_parser():
    expr = (
        "histogram_quantile(0.99, sum by (method, le) (rate(kvxferd_rpc_duration_seconds_bucket"
        '{job=~"$job", code!~"(?i)ok"}[$__rate_interval]))) / on (instance) group_left '
        'sum without (x) (up offset 5m) > 1e3 and kvxferd_rooms{state="a{b}"}'
    )
    assert promql_metric_names(expr) == {"kvxferd_rpc_duration_seconds_bucket", "up", "kvxferd_rooms"}
    assert promql_metric_names("count(kvxferd_build_info)") == {"kvxferd_build_info"}


# --------------------------------------------------------------------------- systemd


def unit_directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values...]}} keeping repeated keys (DeviceAllow=...)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        assert section, f"directive outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a directive: {raw!r}"
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def _seconds(value: str) -> float:
    total = 0.0
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "ms": 0.001}
    for num, unit in re.findall(r"([\d.]+)\s*([a-z]*)", value):
        total += float(num) * units[unit]
    return total


@pytest.fixture(scope="module")
def unit():
    return unit_directives(UNIT)


def _one(unit, section, key):
    values = unit[section].get(key)
    assert values, f"{UNIT.name}: [{section}] {key}= missing"
    return values[-1]


@pytest.mark.parametrize(
    "key,value",
    [
        ("DynamicUser", "no"),
        ("User", "kvxferd"),
        ("Group", "kvxferd"),
        ("RuntimeDirectory", "kvxferd"),
        ("LimitMEMLOCK", "infinity"),
        ("Restart", "on-failure"),
        ("KillSignal", "SIGTERM"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("LockPersonality", "yes"),
        ("DevicePolicy", "closed"),
    ],
)
def test_unit_directive(unit, key, value):
    assert _one(unit, "Service", key) == value


def test_unit_stop_timeout_exceeds_drain_grace(unit):
    timeout = _seconds(_one(unit, "Service", "TimeoutStopSec"))
    assert timeout > drain_grace_default() + 10, (timeout, drain_grace_default())


def test_unit_keeps_gpu_shm_and_ipc_access(unit):
    svc = unit["Service"]
    assert svc.get("PrivateDevices", ["no"])[-1] == "no", "PrivateDevices hides /dev/nvidia*"
    assert svc.get("PrivateIPC", ["no"])[-1] == "no", "CUDA IPC / host pool need the host IPC namespace"
    assert svc.get("MemoryDenyWriteExecute", ["no"])[-1] == "no", "breaks CUDA/Triton JIT"
    assert "TemporaryFileSystem" not in svc
    allow = " ".join(svc.get("DeviceAllow", []))
    assert "nvidia" in allow and "/dev/nvidiactl" in allow and "/dev/nvidia-uvm" in allow
    assert any(p.lstrip("-") == "/dev/shm" for p in " ".join(svc.get("ReadWritePaths", [])).split())
    assert "/dev/shm" not in " ".join(svc.get("InaccessiblePaths", []))


def test_unit_execstart_and_install(unit):
    exec_start = _one(unit, "Service", "ExecStart")
    argv = exec_start.split()
    assert argv[0].endswith("/kvxferd") and argv[1] == "serve", exec_start
    assert "--config" in argv and argv[argv.index("--config") + 1] == "/etc/kvxferd/kvxferd.toml"
    assert "--socket" in argv and argv[argv.index("--socket") + 1] == SOCKET
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"


def test_example_toml_uses_contract_keys_only():
    cfg = tomllib.loads(EXAMPLE_TOML.read_text())
    keys, _ = contract_config()
    assert set(cfg) <= keys, set(cfg) - keys
    assert cfg["socket"] == SOCKET
    assert cfg["drain_grace_s"] == drain_grace_default()
    assert cfg["metrics_port"] == METRICS_PORT
    assert cfg["peer_listen"].rsplit(":", 1)[1] == str(PEER_PORT)
    assert cfg["peer_stream_port"] == PEER_STREAM_PORT


# --------------------------------------------------------------------------- kubernetes


@pytest.fixture(scope="module")
def yaml():
    return pytest.importorskip("yaml", reason="PyYAML is a test dependency (pip install pyyaml)")


def load_docs(yaml, path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


@pytest.fixture(scope="module")
def k8s(yaml) -> dict[str, dict]:
    """{"Kind/name": object} for every manifest under deploy/kubernetes (both kustomizations)."""
    objs = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in load_docs(yaml, path):
            assert isinstance(doc, dict) and "kind" in doc, path
            objs[f"{doc['kind']}/{doc['metadata']['name'] if 'metadata' in doc else path}"] = doc
    return objs


def _pod_containers(spec: dict) -> list[dict]:
    return list(spec.get("containers", [])) + list(spec.get("initContainers", []))


def _kvxferd_container(pod_spec: dict) -> dict:
    found = [c for c in _pod_containers(pod_spec) if c["name"] == "kvxferd"]
    assert len(found) == 1, [c["name"] for c in _pod_containers(pod_spec)]
    return found[0]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _volume_for_mount(pod_spec: dict, container: dict, mount_path: str) -> dict:
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path]
    assert mounts, f"{container['name']}: nothing mounted at {mount_path}"
    vols = {v["name"]: v for v in pod_spec.get("volumes", [])}
    return vols[mounts[0]["name"]]


@pytest.mark.parametrize("kdir", [K8S, K8S / "sidecar"], ids=["daemonset", "sidecar"])
def test_kustomization_lists_every_manifest(yaml, kdir):
    kust = load_docs(yaml, kdir / "kustomization.yaml")[0]
    assert kust["kind"] == "Kustomization"
    listed = set(kust["resources"])
    present = {p.name for p in kdir.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == present, (listed, present)
    assert any(i["name"] == "kvxferd" for i in kust.get("images", []))


def _check_kvxferd_container(pod_spec: dict, c: dict, config_maps: dict) -> None:
    # probes: native gRPC on the peer port, or `kvxferd status`
    for probe in ("readinessProbe", "livenessProbe"):
        p = c.get(probe)
        assert p, f"{probe} missing"
        if "grpc" in p:
            assert p["grpc"]["port"] == PEER_PORT
        else:
            assert p["exec"]["command"][:2] == ["kvxferd", "status"], p
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc-peer": PEER_PORT, "peer-stream": PEER_STREAM_PORT, "metrics": METRICS_PORT}
    env = _env(c)
    assert env.get("KVXFERD_PEER_STREAM_PORT") == str(PEER_STREAM_PORT)
    unknown = {k for k in env if k.startswith("KVXFERD_")} - allowed_env()
    assert not unknown, f"KVXFERD_* variables that are no config key: {unknown}"
    assert env.get("KVXFERD_METRICS_HOST") == "0.0.0.0"
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    # no GPUs taken from the scheduler
    for section in ("limits", "requests"):
        assert not any("nvidia.com/gpu" in k for k in c.get("resources", {}).get(section, {}))
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    sc = c["securityContext"]
    assert "IPC_LOCK" in sc["capabilities"]["add"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["allowPrivilegeEscalation"] is False
    # config: KVXFERD_CONFIG points into a mounted ConfigMap holding a TOML of contract keys
    cfg_path = env["KVXFERD_CONFIG"]
    vol = _volume_for_mount(pod_spec, c, str(Path(cfg_path).parent))
    cm = config_maps[vol["configMap"]["name"]]
    cfg = tomllib.loads(cm["data"][Path(cfg_path).name])
    keys, _ = contract_config()
    assert set(cfg) <= keys, set(cfg) - keys
    assert cfg["socket"] == SOCKET
    args = c.get("args", [])
    assert args[0] == "serve" and args[args.index("--socket") + 1] == SOCKET
    # /dev/shm: the node's, or a memory emptyDir shared inside the pod
    shm = _volume_for_mount(pod_spec, c, "/dev/shm")
    node_shm = shm.get("hostPath", {}).get("path") == "/dev/shm"
    assert node_shm or shm.get("emptyDir", {}).get("medium") == "Memory"


def _config_maps(k8s) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in k8s.values() if o["kind"] == "ConfigMap"}


def _pod_template_annotations_ok(meta: dict) -> None:
    ann = meta.get("annotations", {})
    assert ann.get("prometheus.io/scrape") == "true"
    assert ann.get("prometheus.io/port") == str(METRICS_PORT)
    assert ann.get("prometheus.io/path", "/metrics") == "/metrics"


def test_daemonset(k8s):
    ds = k8s["DaemonSet/kvxferd"]
    tmpl = ds["spec"]["template"]
    spec = tmpl["spec"]
    assert spec["hostIPC"] is True
    assert spec["terminationGracePeriodSeconds"] > drain_grace_default()
    _pod_template_annotations_ok(tmpl["metadata"])
    c = _kvxferd_container(spec)
    _check_kvxferd_container(spec, c, _config_maps(k8s))
    shm = _volume_for_mount(spec, c, "/dev/shm")
    assert shm["hostPath"]["path"] == "/dev/shm", "engines in other pods must share the node's /dev/shm"
    sock = _volume_for_mount(spec, c, SOCKET_DIR)
    assert sock["hostPath"]["path"] == SOCKET_DIR
    assert ds["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()


def test_etcd_survives_a_drain_and_a_node_loss(yaml):
    """3 members, one per node (required anti-affinity on the hostname), and a PodDisruptionBudget that
    lets a drain take one at a time: quorum (2 of 3) is never given up voluntarily."""
    docs = {f"{d['kind']}/{d['metadata']['name']}": d
            for d in yaml.safe_load_all((DEPLOY / "etcd" / "etcd.yaml").read_text())}
    sts, pdb = docs["StatefulSet/etcd"], docs["PodDisruptionBudget/etcd"]
    members = sts["spec"]["replicas"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert members == 3
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == members // 2 + 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (term,) = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()


def test_sidecar_example(k8s):
    deps = [o for o in k8s.values() if o["kind"] in ("Deployment", "Pod", "StatefulSet")]
    assert len(deps) == 1
    tmpl = deps[0]["spec"]["template"] if deps[0]["kind"] != "Pod" else deps[0]
    spec = tmpl["spec"]
    _pod_template_annotations_ok(tmpl["metadata"])
    kv = _kvxferd_container(spec)
    _check_kvxferd_container(spec, kv, _config_maps(k8s))
    if kv in spec.get("initContainers", []):
        assert kv.get("restartPolicy") == "Always", "an init container must be a native sidecar"
    engines = [c for c in spec["containers"] if c["name"] != "kvxferd"]
    assert engines, "the example needs an engine container"
    for path in (SOCKET_DIR, "/dev/shm"):
        kv_vol = _volume_for_mount(spec, kv, path)
        assert "emptyDir" in kv_vol
        for eng in engines:
            assert _volume_for_mount(spec, eng, path) is kv_vol, f"{eng['name']} does not share {path}"
    assert _volume_for_mount(spec, kv, "/dev/shm")["emptyDir"]["medium"] == "Memory"


def test_headless_peer_service(k8s):
    svc = k8s["Service/kvxferd-peers"]
    assert svc["spec"]["clusterIP"] == "None"
    assert {PEER_PORT, PEER_STREAM_PORT} <= {p["port"] for p in svc["spec"]["ports"]}
    ds_labels = k8s["DaemonSet/kvxferd"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= ds_labels.items()


def _container_env_for_loader(container: dict) -> dict[str, str]:
    """The container's KVXFERD_* env with $(VAR) references resolved to sample values."""
    out = {}
    for e in container.get("env", []):
        if e["name"].startswith("KVXFERD_") and "value" in e:
            out[e["name"]] = re.sub(r"\$\(\w+\)", "10.0.0.1", e["value"])
    return out


def test_configs_load_with_the_daemon_loader(k8s, tmp_path):
    """Every shipped config (+ the manifests' env) is accepted by kvxferd.config itself."""
    config = pytest.importorskip("kvxferd.config")
    sock = str(tmp_path / "kvxferd.sock")
    cases = [("systemd", EXAMPLE_TOML.read_text(), {})]
    cms = _config_maps(k8s)
    for obj in k8s.values():
        if obj["kind"] not in ("DaemonSet", "Deployment"):
            continue
        spec = obj["spec"]["template"]["spec"]
        c = _kvxferd_container(spec)
        env = _container_env_for_loader(c)
        cfg_path = env.pop("KVXFERD_CONFIG")
        vol = _volume_for_mount(spec, c, str(Path(cfg_path).parent))
        cases.append((obj["kind"], cms[vol["configMap"]["name"]]["data"][Path(cfg_path).name], env))
    for name, text, env in cases:
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        env = {**env, "KVXFERD_SOCKET": sock}  # the real path is /run/kvxferd, not writable here
        cfg = config.load_config(path, env=env)
        assert cfg.drain_grace_s == drain_grace_default(), name
        assert cfg.metrics_port == METRICS_PORT, name


# --------------------------------------------------------------------------- prometheus


def test_prometheus_config(yaml):
    cfg = load_docs(yaml, PROM / "prometheus.yml")[0]
    for rf in cfg["rule_files"]:
        assert (PROM / rf).is_file(), rf
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    static = [t for j in jobs.values() for sc in j.get("static_configs", []) for t in sc["targets"]]
    assert f"127.0.0.1:{METRICS_PORT}" in static
    assert any("kubernetes_sd_configs" in j for j in jobs.values())


def test_alert_rules_use_contract_metrics(yaml):
    rules = load_docs(yaml, PROM / "kvxferd-alerts.yml")[0]
    allowed = allowed_series({"up"})  # `up` is Prometheus' own scrape health series
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 4
    seen = set()
    for r in alerts:
        names = promql_metric_names(r["expr"])
        assert names, r["alert"]
        assert names <= allowed, (r["alert"], names - allowed)
        assert r["labels"]["severity"] in {"critical", "warning", "info"}
        assert r["annotations"]["summary"]
        seen |= names
    # the alerts the deployment promises: NIXL errors, failing rooms, peers down
    assert {"kvxferd_nixl_errors_total", "kvxferd_rooms_finished_total", "kvxferd_peers"} <= seen
    tests = load_docs(yaml, PROM / "kvxferd-alerts.test.yml")[0]
    assert tests["rule_files"] == ["kvxferd-alerts.yml"]


# --------------------------------------------------------------------------- grafana


def _panels(panels):
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def test_dashboard_structure(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in _panels(dashboard["panels"]):
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        if p["type"] != "row":
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["expr"].strip() and t["refId"], p["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in variables


def test_dashboard_metric_names_are_contract_names(dashboard):
    allowed = allowed_series()
    used = set()
    for p in _panels(dashboard["panels"]):
        for t in p.get("targets", []):
            names = promql_metric_names(t["expr"])
            assert names, (p["title"], t["expr"])
            assert names <= allowed, (p["title"], names - allowed)
            used |= names
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            inner = re.match(r"label_values\((.*),\s*\w+\)$", q)
            assert inner, q
            assert promql_metric_names(inner.group(1)) <= allowed, q
    # what the dashboard promises to show
    required = {
        "kvxferd_rpc_duration_seconds_bucket",  # RPC latency p50/p99 by method
        "kvxferd_rooms",  # rooms by state
        "kvxferd_transfer_bytes_total",  # throughput by peer
        "kvxferd_queue_depth",
        "kvxferd_ring_used_bytes",
        "kvxferd_ring_capacity_bytes",
        "kvxferd_nixl_errors_total",
        "kvxferd_peers",
        "kvxferd_room_duration_seconds_bucket",
    }
    assert required <= used, required - used
    heatmaps = [p for p in _panels(dashboard["panels"]) if p["type"] == "heatmap"]
    assert any(
        "kvxferd_room_duration_seconds_bucket" in t["expr"] and t.get("format") == "heatmap"
        for p in heatmaps
        for t in p["targets"]
    )


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile():
    ins = _dockerfile_instructions()
    froms = [rest for op, rest in ins if op == "FROM"]
    assert froms and all(re.match(r"python:\$\{PYTHON_VERSION\}-slim|python:3\.11-slim", f) for f in froms)
    args = dict(re.match(r"(\w+)=?(.*)", rest).groups() for op, rest in ins if op == "ARG")
    assert args.get("PYTHON_VERSION") == "3.11"
    runs = [rest for op, rest in ins if op == "RUN"]
    torch_re = r"pip install .*torch==(\$\{TORCH_VERSION\}|2\.13\.0)"
    torch_i = next(i for i, r in enumerate(runs) if re.search(torch_re, r))
    pkg_i = next(i for i, r in enumerate(runs) if re.search(r"pip install (--\S+ )*\.(\s|$)", r))
    assert torch_i < pkg_i, "torch must be installed before the package (README order)"
    assert args.get("TORCH_VERSION", "2.13.0") == "2.13.0"
    user = [rest for op, rest in ins if op == "USER"][-1]
    assert user.split(":")[0] not in {"root", "0"}
    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["kvxferd"]
    assert json.loads(dict(ins)["CMD"]) == ["serve"]
    hc = [rest for op, rest in ins if op == "HEALTHCHECK"]
    assert hc and re.search(r'CMD \["kvxferd", "status"', hc[0]), hc
    assert {str(PEER_PORT), str(PEER_STREAM_PORT), str(METRICS_PORT)} <= set(dict(ins)["EXPOSE"].split())


def test_dockerignore_keeps_context_small():
    lines = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert ".git" in lines
    assert not {"kvxferd", "pyproject.toml", "proto", "clients"} & lines


# --------------------------------------------------------------------------- real validators


@pytest.mark.skipif(
    os.environ.get("KVX_VALIDATE_DEPLOY") != "1",
    reason="set KVX_VALIDATE_DEPLOY=1 to run scripts/validate-deploy.sh",
)
def test_validate_deploy_script():
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "validate-deploy.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


# --------------------------------------------------------------------------- deploy policy (issue #41)


def _policy(deploy_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "validate-deploy.sh"), "--policy-only", str(deploy_dir)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})


def _mutate_pod(yaml, path: Path, edit) -> None:
    objs = list(yaml.safe_load_all(path.read_text()))
    for o in objs:
        if o and o["kind"] in ("DaemonSet", "Deployment"):
            edit(o["spec"]["template"]["spec"])
    path.write_text(yaml.safe_dump_all(objs))


def _kv(spec: dict) -> dict:
    return _kvxferd_container(spec)


_MUTATIONS = {
    "no hugepages limit": ("kubernetes/daemonset.yaml", lambda s: _kv(s)["resources"]["limits"].pop("hugepages-2Mi"),
                           "hugepages-2Mi"),
    "SYS_ADMIN added": ("kubernetes/daemonset.yaml",
                        lambda s: _kv(s)["securityContext"]["capabilities"]["add"].append("SYS_ADMIN"), "adds SYS_ADMIN"),
    "no hostIPC": ("kubernetes/daemonset.yaml", lambda s: s.update(hostIPC=False), "hostIPC"),
    "no fsGroup": ("kubernetes/daemonset.yaml", lambda s: s["securityContext"].pop("fsGroup"), "fsGroup"),
    "seccomp off": ("kubernetes/daemonset.yaml",
                    lambda s: s["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccompProfile"),
    "sidecar pool on Memory": ("kubernetes/sidecar/deployment.yaml",
                               lambda s: next(v for v in s["volumes"] if v["name"] == "hugepages")["emptyDir"].update(
                                   medium="Memory"), "HugePages emptyDir"),
}


@pytest.mark.parametrize("mutation", [None, *_MUTATIONS], ids=["as shipped", *_MUTATIONS])
def test_the_deploy_policy_refuses_a_mutated_manifest(yaml, tmp_path, mutation):
    """scripts/validate-deploy.sh --policy-only on a copy of deploy/: as shipped it passes; each
    mutation (a privilege granted, a huge-page or CUDA IPC setting lost) is refused, naming it."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    if mutation is not None:
        rel, edit, _ = _MUTATIONS[mutation]
        _mutate_pod(yaml, copy / rel, edit)
    got = _policy(copy)
    if mutation is None:
        assert got.returncode == 0, got.stdout + got.stderr
        return
    assert got.returncode == 1, got.stdout + got.stderr
    refused = [line for line in got.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1 and _MUTATIONS[mutation][2] in refused[0], got.stdout


@pytest.mark.parametrize("edit,needle", [
    (lambda u: re.sub(r"(?m)^ExecStartPre=-\+/usr/bin/install.*\n", "", u), "ExecStartPre"),
    (lambda u: u.replace("CapabilityBoundingSet=\n", "CapabilityBoundingSet=CAP_SYS_ADMIN\n"), "CapabilityBoundingSet"),
], ids=["no huge_dir ExecStartPre", "CAP_SYS_ADMIN"])
def test_the_deploy_policy_refuses_a_mutated_unit_or_etcd(tmp_path, edit, needle):
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    unit = copy / "systemd" / "kvxferd.service"
    before = unit.read_text()
    unit.write_text(edit(before))
    assert unit.read_text() != before, "the mutation must change the unit"
    got = _policy(copy)
    assert got.returncode == 1 and needle in got.stdout, got.stdout + got.stderr
    # etcd without its PodDisruptionBudget: quorum could be drained away.
    unit.write_text(before)
    etcd = copy / "etcd" / "etcd.yaml"
    etcd.write_text("\n---\n".join(d for d in etcd.read_text().split("\n---\n") if "kind: PodDisruptionBudget" not in d))
    got = _policy(copy)
    assert got.returncode == 1 and "PodDisruptionBudget" in got.stdout, got.stdout + got.stderr
