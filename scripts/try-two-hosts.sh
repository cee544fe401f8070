#!/usr/bin/env bash
# The README's two-node walkthrough, run as written on one machine: hosts A and B are two network
# namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), each with its own daemon and vLLM
# server (a tiny random Llama), a proxy on A, one request through it, `kvxferd status` on both.
# Needs root (ip netns) and `make install-test` (vLLM's CPU build). Leaves nothing behind.
#   sudo scripts/try-two-hosts.sh            # exit 0: the request came back and both daemons saw the room
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
KVX=$ROOT/.venv/bin/kvxferd
WORK=$(mktemp -d /tmp/kvx-2hosts-XXXXXX)
A=kvx2h-a B=kvx2h-b
declare -a PIDS=()

cleanup() {
  # Everything started on a "host" runs in its network namespace: its processes, children included
  # (vLLM's engine cores), are the namespace's pids.
  local ns_pids=()
  for ns in "$A" "$B"; do mapfile -t -O "${#ns_pids[@]}" ns_pids < <(ip netns pids "$ns" 2>/dev/null); done
  for p in "${PIDS[@]}" "${ns_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 3
  for p in "${PIDS[@]}" "${ns_pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  [[ -n "${KEEP:-}" ]] || rm -rf "$WORK"
}
trap cleanup EXIT

ip netns add "$A" && ip netns add "$B"
ip link add kvx2h-va type veth peer name kvx2h-vb
ip link set kvx2h-va netns "$A" && ip link set kvx2h-vb netns "$B"
ip -n "$A" addr add 10.77.0.1/24 dev kvx2h-va && ip -n "$B" addr add 10.77.0.2/24 dev kvx2h-vb
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set kvx2h-va up && ip -n "$B" link set kvx2h-vb up

# Step 1: one peer secret, on both hosts (the same file here).
head -c 32 /dev/urandom > "$WORK/peer.secret" && chmod 600 "$WORK/peer.secret"
"$PY" examples/tiny_llama.py "$WORK/model" >/dev/null
MODEL=$WORK/model

# Each "host" gets its own runtime dir (the same default socket path) and its own host name (the
# default daemon_id is hostname:port, and two daemons may not share one), as two machines would.
in_host() {  # in_host NS CMD...: CMD on that host, with its environment
  local ns=$1; shift
  mkdir -p "$WORK/$ns"
  # shellcheck disable=SC2016  # $0 and $@ are the inner shell's
  ip netns exec "$ns" unshare --uts -- bash -c 'hostname "$0" && exec "$@"' "$ns" \
    env "XDG_RUNTIME_DIR=$WORK/$ns" UCX_TCP_PORT_RANGE=20000-20100 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 "$@"
}
run_in() {  # run_in NS NAME CMD...: in the background, output to $WORK/NAME.log
  local ns=$1 name=$2; shift 2
  in_host "$ns" "$@" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
}

# Step 2: the daemons.
start_daemon() {  # start_daemon NS ADDRESS
  run_in "$1" "daemon-$1" "$KVX" serve --peer-listen "$2:7471" --set "peer_secret_file=$WORK/peer.secret" \
    --set peer_stream_port=7472 --host-pool-bytes 256MiB --ready-file "$WORK/$1.ready"
}
start_daemon "$A" 10.77.0.1
start_daemon "$B" 10.77.0.2
for ns in "$A" "$B"; do
  for _ in $(seq 120); do [[ -s "$WORK/$ns.ready" ]] && break; sleep 0.5; done
  [[ -s "$WORK/$ns.ready" ]] || { echo "daemon in $ns did not start:"; tail -20 "$WORK/daemon-$ns.log"; exit 1; }
done

# Step 3: the engines.
KTC='{"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxfer_client.vllm", "kv_role": "ROLE"}'
run_in "$A" vllm-a "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 10.77.0.1 --port 8100 \
  --max-model-len 1024 --block-size 32 --kv-transfer-config "${KTC/ROLE/kv_producer}"
run_in "$B" vllm-b "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 10.77.0.2 --port 8200 \
  --max-model-len 1024 --block-size 32 --kv-transfer-config "${KTC/ROLE/kv_consumer}"
wait_vllm() {  # wait_vllm NS HOST:PORT LOG
  for _ in $(seq 300); do
    ip netns exec "$1" curl -sf "http://$2/health" >/dev/null && return 0
    sleep 1
  done
  echo "vLLM in $1 did not start:"; tail -30 "$WORK/$3.log"; exit 1
}
wait_vllm "$A" 10.77.0.1:8100 vllm-a
wait_vllm "$B" 10.77.0.2:8200 vllm-b

# Step 4: the proxy, on host A.
run_in "$A" proxy "$PY" -m kvxfer_client.proxy --prefill http://10.77.0.1:8100 --decode http://10.77.0.2:8200 \
  --host 127.0.0.1 --port 8000
for _ in $(seq 60); do ip netns exec "$A" curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 0.5; done

# Step 5: a request, then status on both hosts.
OUT=$(ip netns exec "$A" curl -sS http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"the quick brown fox jumps over the lazy dog\", \"max_tokens\": 8, \"temperature\": 0}")
echo "$OUT"
STATUS_A=$(in_host "$A" "$KVX" status --json)
STATUS_B=$(in_host "$B" "$KVX" status --json)
"$PY" - "$OUT" "$STATUS_A" "$STATUS_B" <<'PYEOF'
import json, sys
out, a, b = (json.loads(x) for x in sys.argv[1:4])
text = out["choices"][0]["text"]
assert out["choices"][0]["finish_reason"] == "length", out
assert (out.get("kv_transfer_params") or {}).get("kvxfer_loaded_tokens"), f"decode did not load through kvxferd: {out}"
print(f"completion: {text!r}; loaded {out['kv_transfer_params']['kvxfer_loaded_tokens']} prompt tokens through kvxferd")
for name, st in (("A", a), ("B", b)):
    peers = st.get("peers") or []
    print(f"host {name}: {len(st.get('engines') or [])} engine(s), peers {[ (p.get('address'), p.get('state')) for p in peers ]}")
PYEOF
echo "two-host walkthrough: OK"
