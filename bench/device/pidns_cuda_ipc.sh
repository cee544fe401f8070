#!/usr/bin/env bash
# CUDA IPC between an engine and kvxferd in different PID namespaces, one IPC namespace (issue #41):
# what the DaemonSet (hostIPC) and the sidecar (one pod) need for the engine's CUDA ring. Run from the
# repo root on the GPU box, carrying .whl/ as for gpu_e2e.sh (bench/device/make_wheels.sh):
#   bash bench/device/pidns_cuda_ipc.sh
# Each scenario starts a prefill and a decode daemon and one engine process (bench/device/
# pidns_engine.py: a prefill and a decode engine whose staging rings are CUDA tensors the daemons
# open with cudaIpcOpenMemHandle), moves one room and compares every byte on the GPU:
#   same_pidns    everything in the box's PID namespace (the baseline)
#   engine_pidns  daemons in the host's, the engine in its own (a DaemonSet with hostPID: true)
#   all_pidns     each daemon and the engine in a PID namespace of its own, all PID 1 there
#                 (Kubernetes without hostPID / shareProcessNamespace: every container's PID 1)
#   all_pidns_distinct  the same, but the engine works as PID 2: the PIDs differ
#   shared_pidns  daemons and engine in one new PID namespace (a pod with shareProcessNamespace)
# Namespaces by `unshare --pid --fork --mount-proc` (root): the IPC namespace stays shared, as
# hostIPC or one pod gives it. Writes $OUT/pidns-cuda-ipc.json (one row per scenario: ok,
# byte_exact, error, PIDs and namespaces seen), $OUT/pidns-logs.tar.gz (daemon logs) and prints a
# table; exits 0 when the scenarios the manifests rely on moved byte-exact: same_pidns, engine_pidns
# (the DaemonSet's hostPID) and shared_pidns (the sidecar's shareProcessNamespace). all_pidns is
# expected to fail: CUDA's legacy IPC refuses a handle whose exporter PID equals the opener's own
# (cudaIpcOpenMemHandle: 201 invalid device context), and PID 1 meets PID 1 there.
set -uo pipefail
ONE_ROOT=/tmp/kvx-pidns

if [ "${1:-}" = --one ]; then
  # --one NAME DAEMON_PREFIX ENGINE_PREFIX: one scenario, in whatever PID namespace this runs in.
  name=$2 dpre=$3 epre=$4
  dir=$ONE_ROOT/$name
  rm -rf "$dir" && mkdir -p "$dir"
  pids=()
  for role in prefill decode; do
    # shellcheck disable=SC2086  # the prefixes are word lists (unshare and its options) or empty
    $dpre python3 -m kvxferd serve --socket "$dir/$role.sock" --peer-listen 127.0.0.1:0 --metrics-port -1 \
      --host-pool-bytes 64MiB --daemon-id "$name-$role" --ready-file "$dir/$role.ready" --log-format text \
      >"$dir/$role.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    role=$([ "$i" = 0 ] && echo prefill || echo decode)
    for _ in $(seq 900); do [ -s "$dir/$role.ready" ] || ! kill -0 "${pids[$i]}" 2>/dev/null && break; sleep 0.1; done
    [ -s "$dir/$role.ready" ] || echo "{\"daemon_not_ready\": \"$role\"}" >"$dir/$role.ready"
  done
  # shellcheck disable=SC2086
  timeout 120 $epre python3 bench/device/pidns_engine.py "$dir/prefill.sock" "$dir/decode.sock" "$dir/engine.json" \
    >"$dir/engine.log" 2>&1
  # unshare --fork ignores SIGTERM while it waits: the daemon under it (its child) gets it.
  for p in "${pids[@]}"; do
    kill -TERM "$(cat "/proc/$p/task/$p/children" 2>/dev/null)" "$p" 2>/dev/null
  done
  for p in "${pids[@]}"; do
    for _ in $(seq 300); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
  done
  python3 - "$name" "$dir" <<'EOF'
import json, os, sys
name, d = sys.argv[1:3]
row = {"scenario": name, "tester_pidns": os.readlink("/proc/self/ns/pid")}
try:
    row.update(json.load(open(f"{d}/engine.json")))
except (OSError, ValueError) as exc:
    row.update(ok=False, error=f"no engine result ({exc}): " + open(f"{d}/engine.log").read()[-1500:])
for role in ("prefill", "decode"):
    try:
        ready = json.load(open(f"{d}/{role}.ready"))
    except (OSError, ValueError):
        ready = {}
    row[f"{role}_daemon_pid"] = ready.get("pid", ready.get("daemon_not_ready"))
    log = open(f"{d}/{role}.log", errors="replace").read()
    row[f"{role}_log_problems"] = [l for l in log.splitlines() if any(w in l for w in ("ERROR", "CUDA", "cuda_ipc", "Traceback"))][-6:]
with open(f"{os.path.dirname(d)}/rows.jsonl", "a") as fh:
    fh.write(json.dumps(row) + "\n")
EOF
  exit 0
fi

# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
rm -rf "$ONE_ROOT" && mkdir -p "$ONE_ROOT"
UNSHARE="unshare --pid --fork --mount-proc --kill-child=SIGTERM"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  unshare --version | head -1
  echo "this shell: pid $$ in $(readlink /proc/self/ns/pid), ipc $(readlink /proc/self/ns/ipc)"
} 2>&1 | tee "$OUT/env.txt"

# Each scenario is bounded (daemon start <= 90 s, the room <= 120 s, stops <= 60 s); the logs so far
# are packed after each, so a call cut short still brings back what ran.
ONE=(timeout -k 10 300 bash "$0" --one)
for s in same_pidns engine_pidns all_pidns all_pidns_distinct shared_pidns; do
  echo "== $s ($(date -u +%T))"
  # shellcheck disable=SC2086  # $UNSHARE is a word list (the command and its options)
  case $s in
    same_pidns) "${ONE[@]}" $s "" "" ;;
    engine_pidns) "${ONE[@]}" $s "" "$UNSHARE" ;;
    all_pidns) "${ONE[@]}" $s "$UNSHARE" "$UNSHARE" ;;
    all_pidns_distinct) "${ONE[@]}" $s "$UNSHARE" "env KVX_ENGINE_NOT_PID1=1 $UNSHARE" ;;
    shared_pidns) timeout -k 10 300 $UNSHARE bash "$0" --one $s "" "" ;;
  esac
  tail -1 "$ONE_ROOT/rows.jsonl" 2>/dev/null | cut -c1-400
  tar -C /tmp -czf "$OUT/pidns-logs.tar.gz" kvx-pidns
done
python3 - "$OUT" "$ONE_ROOT/rows.jsonl" <<'EOF'
import json, sys
out, rows_path = sys.argv[1:3]
rows = [json.loads(line) for line in open(rows_path)]
json.dump({"env": open(f"{out}/env.txt").read(), "scenarios": rows}, open(f"{out}/pidns-cuda-ipc.json", "w"), indent=1)
print(f"{'scenario':<14}{'ok':<7}{'bytes':>9}  engine pid / daemon pids   error")
for r in rows:
    print(f"{r['scenario']:<14}{str(r.get('ok')):<7}{r.get('bytes', 0):>9}  {r.get('engine_pid')} / "
          f"{r.get('prefill_daemon_pid')},{r.get('decode_daemon_pid')}   {r.get('error', '')[:300]}")
need = {"same_pidns", "engine_pidns", "shared_pidns"}
sys.exit(0 if all(r.get("ok") for r in rows if r["scenario"] in need) and need <= {r["scenario"] for r in rows} else 1)
EOF
