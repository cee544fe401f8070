"""What the shipped deployments must set for kvxferd's host pool and CUDA IPC, and must not grant
(issue #41). Run by scripts/validate-deploy.sh on deploy/ (or on a copy: tests/test_deploy.py
checks that a mutated manifest is refused). Prints one line per finding; exits 1 on any.

  huge pages   DaemonSet and sidecar: hugepages-2Mi requests = limits >= host_pool_bytes, a
               HugePages emptyDir mounted at the ConfigMap's huge_dir, fsGroup = the daemon's group;
               systemd: the TOML's huge_dir made by a privileged ExecStartPre, writable, after
               dev-hugepages.mount
  privileges   no SYS_ADMIN anywhere, capabilities dropped, no privileged container, no privilege
               escalation, the default seccomp profile; systemd: empty CapabilityBoundingSet,
               NoNewPrivileges
  CUDA IPC     the engines' IPC namespace (hostIPC / one pod) and their PID namespace (hostPID /
               shareProcessNamespace): bench/device/pidns_cuda_ipc.sh shows why
  etcd         three members, required anti-affinity per node, a PodDisruptionBudget

Needs PyYAML. Usage: python3 scripts/deploy_policy.py [DEPLOY_DIR]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import tomllib
import yaml

HUGE_MEDIA = {"HugePages", "HugePages-2Mi"}
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1}

problems: list[str] = []


def need(ok: object, what: str) -> bool:
    if not ok:
        problems.append(what)
    return bool(ok)


def quantity(text: object) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", str(text))
    return int(m.group(1)) * _UNITS[m.group(2)] if m else -1


def docs(path: Path) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(path.read_text()) if d}


def check_pod(where: str, spec: dict[str, Any], toml_text: str, shares_pid: str) -> None:
    cfg = tomllib.loads(toml_text)
    kv = [c for c in spec.get("containers", []) + spec.get("initContainers", []) if c["name"] == "kvxferd"]
    if not need(len(kv) == 1, f"{where}: one container named kvxferd"):
        return
    c = kv[0]
    pod_sc, sc = spec.get("securityContext", {}), c.get("securityContext", {})
    # Huge pages: the pool's pages, a hugetlbfs for its file, and the right to write there.
    res = c.get("resources", {})
    lim, req = res.get("limits", {}).get("hugepages-2Mi"), res.get("requests", {}).get("hugepages-2Mi", res.get("limits", {}).get("hugepages-2Mi"))
    if need(lim is not None and lim == req, f"{where}: kvxferd needs resources hugepages-2Mi, requests = limits"):
        need(quantity(lim) >= int(cfg.get("host_pool_bytes", 256 << 20)),
             f"{where}: hugepages-2Mi ({lim}) below host_pool_bytes ({cfg.get('host_pool_bytes')})")
    huge_dir = cfg.get("huge_dir", "")
    need(huge_dir and cfg.get("pool_backing", "auto") in ("auto", "huge_dir"),
         f"{where}: the config sets no huge_dir (pool_backing auto or huge_dir)")
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    mounted = {m["mountPath"]: vols.get(m["name"], {}) for m in c.get("volumeMounts", [])}
    need(mounted.get(huge_dir, {}).get("emptyDir", {}).get("medium") in HUGE_MEDIA,
         f"{where}: no HugePages emptyDir mounted at huge_dir {huge_dir!r}")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser", 0))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    need(uid == 0 or (pod_sc.get("fsGroup") is not None and pod_sc.get("fsGroup") == gid),
         f"{where}: a non-root daemon needs fsGroup = its group ({gid}) to create its pool file in huge_dir")
    # Least privilege: nothing of this needs more than IPC_LOCK.
    for ct in spec.get("containers", []) + spec.get("initContainers", []):
        csc = ct.get("securityContext", {})
        need("SYS_ADMIN" not in [a.upper().removeprefix("CAP_") for a in csc.get("capabilities", {}).get("add", [])],
             f"{where}: container {ct['name']} adds SYS_ADMIN")
        need(not csc.get("privileged"), f"{where}: container {ct['name']} is privileged")
    need("ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}: kvxferd must drop ALL capabilities")
    need(sc.get("allowPrivilegeEscalation") is False, f"{where}: kvxferd must set allowPrivilegeEscalation: false")
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
    need(seccomp == "RuntimeDefault", f"{where}: seccompProfile must be RuntimeDefault, got {seccomp}")
    # CUDA IPC: the engines' IPC and PID namespaces (bench/device/pidns_cuda_ipc.sh).
    if shares_pid == "host":
        need(spec.get("hostIPC") is True, f"{where}: hostIPC: true (CUDA IPC handles of engine pods)")
        need(spec.get("hostPID") is True, f"{where}: hostPID: true (legacy CUDA IPC across pods)")
    else:
        need(spec.get("shareProcessNamespace") is True, f"{where}: shareProcessNamespace: true (legacy CUDA IPC)")


def unit_keys(path: Path) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        k, eq, v = line.partition("=")
        if eq and not line.lstrip().startswith(("#", ";", "[")):
            keys.setdefault(k.strip(), []).append(v.strip())
    return keys


def check_systemd(d: Path) -> None:
    unit, cfg = unit_keys(d / "systemd" / "kvxferd.service"), tomllib.loads((d / "systemd" / "kvxferd.toml").read_text())
    huge_dir = cfg.get("huge_dir", "")
    need(huge_dir and cfg.get("pool_backing", "auto") in ("auto", "huge_dir"), "systemd: kvxferd.toml sets no huge_dir")
    pre = [v for v in unit.get("ExecStartPre", []) if "+" in v.split(None, 1)[0] and huge_dir and v.split()[-1] == huge_dir]
    need(pre and "install" in pre[0] and "-o kvxferd" in pre[0],
         f"systemd: no privileged ExecStartPre (+) making huge_dir {huge_dir!r} for user kvxferd")
    need(any(p.lstrip("-") == huge_dir for v in unit.get("ReadWritePaths", []) for p in v.split()),
         f"systemd: huge_dir {huge_dir!r} not in ReadWritePaths")
    if huge_dir.startswith("/dev/hugepages/"):
        for key in ("Wants", "After"):
            need(any("dev-hugepages.mount" in v for v in unit.get(key, [])), f"systemd: {key}=dev-hugepages.mount")
    need(unit.get("CapabilityBoundingSet", [None])[-1] == "", "systemd: CapabilityBoundingSet= must be empty")
    need(unit.get("AmbientCapabilities", [""])[-1] == "", "systemd: AmbientCapabilities= must be empty")
    need(unit.get("NoNewPrivileges", [""])[-1] == "yes", "systemd: NoNewPrivileges=yes")
    need(unit.get("PrivateIPC", ["no"])[-1] == "no", "systemd: PrivateIPC would hide the engines' CUDA IPC handles")
    need(not any("SYS_ADMIN" in v for k in ("CapabilityBoundingSet", "AmbientCapabilities") for v in unit.get(k, [])),
         "systemd: CAP_SYS_ADMIN granted")


def check_etcd(d: Path) -> None:
    objs = docs(d / "etcd" / "etcd.yaml")
    sts, pdb = objs.get("StatefulSet/etcd"), objs.get("PodDisruptionBudget/etcd")
    if not need(sts and pdb, "etcd: a StatefulSet and a PodDisruptionBudget named etcd"):
        return
    assert sts is not None and pdb is not None
    labels = sts["spec"]["template"]["metadata"]["labels"]
    need(pdb["spec"].get("minAvailable") == sts["spec"]["replicas"] // 2 + 1, "etcd: PDB minAvailable must keep quorum")
    need(pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), "etcd: the PDB does not select the members")
    terms = sts["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", [])
    need(any(t.get("topologyKey") == "kubernetes.io/hostname" for t in terms), "etcd: required anti-affinity per node")


def main(d: Path) -> int:
    k8s = {**docs(d / "kubernetes" / "daemonset.yaml"), **docs(d / "kubernetes" / "configmap.yaml")}
    ds = k8s["DaemonSet/kvxferd"]
    check_pod("DaemonSet", ds["spec"]["template"]["spec"], k8s["ConfigMap/kvxferd-config"]["data"]["kvxferd.toml"], "host")
    side = {**docs(d / "kubernetes" / "sidecar" / "deployment.yaml"), **docs(d / "kubernetes" / "sidecar" / "configmap.yaml")}
    dep = next(o for k, o in side.items() if k.startswith("Deployment/"))
    check_pod("sidecar", dep["spec"]["template"]["spec"], side["ConfigMap/kvxferd-sidecar-config"]["data"]["kvxferd.toml"], "pod")
    check_systemd(d)
    check_etcd(d)
    for p in problems:
        print(f"REFUSED {p}")
    print(f"deploy policy: {len(problems)} problem(s) in {d}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "deploy")))
