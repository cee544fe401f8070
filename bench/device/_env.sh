# shellcheck shell=bash
# Sourced by the bench/device/*.sh scripts on the GPU box: installs the carried .whl/ into /tmp/site
# and sets the environment the daemons and tests need there. EXTRA_WHEELS: more wheels to install.
OUT=${OUT:-/tmp/kvxferd-out}
mkdir -p "$OUT"
SITE=/tmp/site
if [ -d .whl ]; then
  mkdir -p "$SITE"
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl ${EXTRA_WHEELS:-} || exit 1
  for t in .whl/*.tar.xz; do [ -e "$t" ] && tar -C "$SITE" -xJf "$t"; done
fi
export PYTHONPATH=$SITE:.:clients/python PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# UCX's CUDA memory hooks (libucm_cuda) link libcudart.so.13: torch's CUDA runtime wheel has it.
CUDART_DIR=$(python3 -c 'import glob, os, site
for d in site.getsitepackages():
    for f in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.13*"), recursive=True):
        print(os.path.dirname(f)); raise SystemExit' 2>/dev/null)
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH=$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULES=^efa
