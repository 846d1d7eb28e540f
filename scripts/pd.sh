#!/usr/bin/env bash
# Prefill/decode pair of `vllm serve` engines exchanging KV through p2pworker, plus the PD router.
#
#   MODEL=/path/to/model scripts/pd.sh start     # start prefill, decode, router; wait until healthy
#   MODEL=... scripts/pd.sh start prefill         # only the roles named (prefill, decode, router): one machine each
#   scripts/pd.sh status                         # which processes are up
#   scripts/pd.sh stop                           # stop everything (bounded), report leftovers
#   MODEL=... scripts/pd.sh restart-decode       # restart only the decode engine
#
# Every engine loads vLLM's OffloadingConnector with the P2PWorkerTier secondary tier (which
# spawns that engine's p2pworker).  On vLLM's CPU backend (PLATFORM=cpu, the default) the
# offloading spec is vllm_adapter.cpu_spec.CPUTieringOffloadingSpec; on GPUs it is vLLM's own
# TieringOffloadingSpec.  The tests in tests/e2e run exactly this script.
#
# Environment (defaults in brackets):
#   MODEL                model path or name (required for start)
#   VENV [.venv-vllmcpu032]  virtualenv with vLLM and this project installed
#   RUN_DIR [/tmp/p2pworker-pd]  logs, pid files, generated configs, the shared secret
#   PLATFORM [cpu]       cpu | gpu: which offloading spec the engines load
#   PREFILL_HTTP [8100], DECODE_HTTP [8200], ROUTER_PORT [8000]: HTTP ports
#   PREFILL_HOST, DECODE_HOST, ROUTER_HOST [127.0.0.1]: where each role listens (engine HTTP and its worker's control
#                        port) and where the others reach it; on two machines give each its own address, the same
#                        values on both, and the same P2PWORKER_SECRET
#   PREFILL_P2P [5710], DECODE_P2P [5810]: the workers' control ports (base; + DP index)
#   CPU_BYTES [268435456]  size of each engine's CPU KV tier (/dev/shm)
#   PREFILL_CPU_BYTES, DECODE_CPU_BYTES [CPU_BYTES]  one engine's CPU KV tier, when the two differ
#   PREFILL_WORKER_METRICS, DECODE_WORKER_METRICS [0]: >0: that engine's p2pworker serves Prometheus metrics on
#                        127.0.0.1:<port>/metrics (given inline as the tier's worker_settings, over configs/<role>.toml)
#   SAME_HOST [1]        0: the workers never copy out of a same-host peer's region file ([data] same_host = false;
#                        NIXL even when both engines run here)
#   DECODE_OFFLOAD_PROMPT_ONLY [1]  0: the decode engine offloads its generated KV too (offload_prompt_only: false),
#                        so a prefill engine's next turn can pull the conversation's history from it (multi-turn P/D)
#   P2PWORKER_SECRET     shared control-plane secret (generated into RUN_DIR if unset)
#   HEALTH_TIMEOUT_S [240], STOP_TIMEOUT_S [30]
#   VLLM_ARGS            extra arguments for both engines (e.g. "--dtype float32 --max-model-len 2048")
#   PREFILL_ENV / DECODE_ENV  extra "K=V K=V" environment for one engine (e.g. VLLM_CPU_OMP_THREADS_BIND=0)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv-vllmcpu032}
RUN_DIR=${RUN_DIR:-/tmp/p2pworker-pd}
PLATFORM=${PLATFORM:-cpu}
PREFILL_HTTP=${PREFILL_HTTP:-8100}
DECODE_HTTP=${DECODE_HTTP:-8200}
ROUTER_PORT=${ROUTER_PORT:-8000}
PREFILL_P2P=${PREFILL_P2P:-5710}
DECODE_P2P=${DECODE_P2P:-5810}
CPU_BYTES=${CPU_BYTES:-268435456}
PREFILL_CPU_BYTES=${PREFILL_CPU_BYTES:-$CPU_BYTES}
DECODE_CPU_BYTES=${DECODE_CPU_BYTES:-$CPU_BYTES}
PREFILL_HOST=${PREFILL_HOST:-127.0.0.1}
DECODE_HOST=${DECODE_HOST:-127.0.0.1}
ROUTER_HOST=${ROUTER_HOST:-127.0.0.1}
PREFILL_WORKER_METRICS=${PREFILL_WORKER_METRICS:-0}
DECODE_WORKER_METRICS=${DECODE_WORKER_METRICS:-0}
SAME_HOST=${SAME_HOST:-1}
DECODE_OFFLOAD_PROMPT_ONLY=${DECODE_OFFLOAD_PROMPT_ONLY:-1}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-240}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-30}
PY="$VENV/bin/python"
# a venv that needs more environment to serve says so in p2pw-env.sh (scripts/vllm_cpu034.sh writes one: the kernel
# library its CPU build of vLLM 0.34 loads)
if [ -f "$VENV/p2pw-env.sh" ]; then
  # shellcheck disable=SC1091
  . "$VENV/p2pw-env.sh"
fi

die() { echo "pd.sh: $*" >&2; exit 1; }
pidof_role() { [ -f "$RUN_DIR/$1.pid" ] && cat "$RUN_DIR/$1.pid" || true; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }

kv_config() {  # role port engine_id -> the --kv-transfer-config JSON
  "$PY" - "$@" <<'EOF'
import json, sys
role, port, engine_id, platform, cpu_bytes, root, metrics, host, same_host, prompt_only = sys.argv[1:11]
spec = ({"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "vllm_adapter.cpu_spec"}
        if platform == "cpu" else {"spec_name": "TieringOffloadingSpec"})
tier = {"type": "P2PWorkerTier", "module_path": "vllm_adapter.tier", "host": host, "port": int(port),
        "worker_config": f"{root}/configs/{role}.toml"}
settings = {}  # inline settings over the file
if int(metrics):  # the worker's Prometheus endpoint
    settings["worker"] = {"metrics_port": int(metrics)}
if same_host == "0":  # never copy out of a same-host peer's region file: NIXL even on one host
    settings["data"] = {"same_host": False}
if settings:
    tier["worker_settings"] = settings
print(json.dumps({
    "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
    "kv_connector_extra_config": {**spec, "cpu_bytes_to_use": int(cpu_bytes), "secondary_tiers": [tier],
                                  # false: generated KV is offloaded too (a peer's next turn pulls the history)
                                  "offload_prompt_only": prompt_only != "0"}}))
EOF
}

start_engine() {  # role http_port p2p_port extra_env worker_metrics_port host
  local role=$1 http=$2 p2p=$3 extra_env=$4 metrics=$5 host=$6 engine_id cfg rpc
  engine_id="p2pw-$role-$$-$RANDOM"  # $RANDOM: pids repeat across PID namespaces (emulated hosts)
  local prompt_only=1 cpu_bytes=$PREFILL_CPU_BYTES
  [ "$role" = decode ] && prompt_only=$DECODE_OFFLOAD_PROMPT_ONLY && cpu_bytes=$DECODE_CPU_BYTES
  cfg=$(kv_config "$role" "$p2p" "$engine_id" "$PLATFORM" "$cpu_bytes" "$ROOT" "$metrics" "$host" "$SAME_HOST" \
    "$prompt_only")
  echo "$cfg" > "$RUN_DIR/$role.kv.json"
  echo "$engine_id" > "$RUN_DIR/$role.engine_id"
  # vLLM's ZMQ ipc sockets (VLLM_RPC_BASE_PATH, else $TMPDIR: /tmp) outlive a SIGTERMed engine (an e2e run left 56 in
  # /tmp): each engine gets its own directory, removed at stop.  Short, under /tmp: a socket path has 108 bytes.
  rpc=$(mktemp -d "/tmp/p2pw-pd-$role.XXXXXX")
  echo "$rpc" > "$RUN_DIR/$role.rpc_dir"
  # shellcheck disable=SC2086  # VLLM_ARGS and extra_env are word lists on purpose
  env HF_HUB_OFFLINE=1 P2PWORKER_SECRET="$P2PWORKER_SECRET" VLLM_RPC_BASE_PATH="$rpc" $extra_env \
    setsid "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "${SERVED_NAME:-$MODEL}" \
      --host "$host" --port "$http" --kv-transfer-config "$cfg" --shutdown-timeout 10 ${VLLM_ARGS:-} \
      > "$RUN_DIR/$role.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/$role.pid"
}

show_log() {  # role why: the root cause first (vLLM's "root cause above" is far above the last lines), then the tail
  local role=$1 why=$2 log="$RUN_DIR/$1.log"
  echo "pd.sh: $role $why; error lines of $log:" >&2
  # vLLM prefixes engine-core lines with "(EngineCore_DP0 pid=N)"; traceback frames ("File ...") are left out
  grep -n -i -E "error|exception|traceback|killed|signal|P2PError|cannot|failed" "$log" | grep -v -E 'File "' \
    | head -n 40 >&2 || true
  echo "pd.sh: last lines of $log:" >&2
  tail -n 25 "$log" >&2
}

wait_health() {  # role url
  local role=$1 url=$2 deadline=$((SECONDS + HEALTH_TIMEOUT_S))
  while [ $SECONDS -lt $deadline ]; do
    alive "$(pidof_role "$role")" || { show_log "$role" "exited before it was healthy"; return 1; }
    "$PY" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url" 2>/dev/null && return 0
    sleep 1
  done
  show_log "$role" "not healthy within ${HEALTH_TIMEOUT_S} s"
  return 1
}

# prints the router's /health body; exits 0 only if it answered 200 and lists every configured instance up (200
# alone says each role has one up; several instances of a role could still be starting)
ROUTER_READY_PY='
import json, sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
print(body.decode(errors="replace"))
h = json.loads(body)
sys.exit(0 if code == 200 and all(i["state"] == "up" for i in h["prefill"] + h["decode"]) else 1)
'

wait_router() {  # url: the router is ready once it has every configured instance up (it probes them itself)
  local url=$1 deadline=$((SECONDS + HEALTH_TIMEOUT_S)) last=""
  while [ $SECONDS -lt $deadline ]; do
    alive "$(pidof_role router)" || { show_log router "exited before it was healthy"; return 1; }
    last=$("$PY" -c "$ROUTER_READY_PY" "$url" 2>/dev/null) && return 0
    sleep 1
  done
  echo "pd.sh: router has not every instance up within ${HEALTH_TIMEOUT_S} s; its last /health: ${last:-no answer}" >&2
  show_log router "not ready within ${HEALTH_TIMEOUT_S} s"
  return 1
}

remove_rpc_dir() {  # role: the engine's ipc socket directory (start_engine), once nothing of it runs
  local f="$RUN_DIR/$1.rpc_dir" dir
  [ -f "$f" ] || return 0
  dir=$(cat "$f")
  case "$dir" in /tmp/p2pw-pd-"$1".*) rm -rf -- "$dir" ;; esac  # only what start_engine made
  rm -f "$f"
}

stop_role() {  # TERM the leader (vLLM shuts its engine core and our worker down in order), then KILL the group
  local role=$1 pid deadline t0=$SECONDS
  pid=$(pidof_role "$role")
  rm -f "$RUN_DIR/$role.pid"
  alive "$pid" || { remove_rpc_dir "$role"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  while alive "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  if alive "$pid"; then
    echo "pd.sh: $role (pid $pid) still up after ${STOP_TIMEOUT_S} s; killing its process group" >&2
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  # children (engine core, p2pworker) follow their parent; give them the same bound
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  while pgrep -g "$pid" >/dev/null 2>&1 && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  if pgrep -g "$pid" >/dev/null 2>&1; then
    echo "pd.sh: $role leftovers in group $pid: $(pgrep -g "$pid" | tr '\n' ' '); killing" >&2
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  remove_rpc_dir "$role"
  echo "pd.sh: $role stopped in $((SECONDS - t0)) s" >&2
}

cmd_stop() {
  [ -d "$RUN_DIR" ] || return 0
  stop_role router
  stop_role decode &
  stop_role prefill &
  wait
  local left=0 id removed
  for role in prefill decode; do
    [ -f "$RUN_DIR/$role.engine_id" ] || continue
    id=$(cat "$RUN_DIR/$role.engine_id")
    for f in /dev/shm/vllm_offload_"$id"*; do
      [ -e "$f" ] || continue
      echo "pd.sh: removing leftover $f (its engine is gone)" >&2
      rm -f "$f"; left=1
    done
    # admin sockets of this engine's workers (p2pworker-vllm-<engine id>-...): each worker removes its own, but
    # not one killed with its engine (vLLM kills an engine core, and its children, that outlive its shutdown timeout)
    for f in /tmp/p2pworker-vllm-"$id"-*.admin; do
      [ -e "$f" ] || continue
      echo "pd.sh: removing leftover $f (its worker is gone)" >&2
      rm -f "$f"; left=1
    done
    # rings of this engine's workers (the adapter names them p2pw_vllm-<engine id>_...): gone unless one crashed
    removed=$("$VENV/bin/p2pworker" sweep "p2pw_vllm-$id" 2>/dev/null) || removed=""
    if [ -n "$removed" ]; then
      echo "pd.sh: removed leftover rings of $role: $removed" >&2
      left=1
    fi
  done
  return $left
}

cmd_start() {  # [role ...]: prefill, decode, router (default: all three, on this machine)
  local roles=("$@") role ok
  [ ${#roles[@]} -gt 0 ] || roles=(prefill decode router)
  for role in "${roles[@]}"; do
    case "$role" in prefill|decode|router) ;; *) echo "pd.sh: unknown role '$role' (prefill, decode, router)" >&2; exit 2 ;; esac
  done
  [ -n "${MODEL:-}" ] || [ "${roles[*]}" = router ] || die "set MODEL"
  [ -x "$PY" ] || die "no python in $VENV (run scripts/setup.sh --vllm)"
  mkdir -p "$RUN_DIR"
  for role in "${roles[@]}"; do
    alive "$(pidof_role $role)" && die "$role already running (pid $(pidof_role $role)); scripts/pd.sh stop first"
  done
  if [ -z "${P2PWORKER_SECRET:-}" ]; then
    # one machine: a secret of our own; roles spread over machines must share one, so it has to be given
    [ ${#roles[@]} -eq 3 ] || die "set P2PWORKER_SECRET (the same on every machine) to start only: ${roles[*]}"
    [ -s "$RUN_DIR/secret" ] || (umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(32))' > "$RUN_DIR/secret")
    P2PWORKER_SECRET=$(cat "$RUN_DIR/secret")
  fi
  export P2PWORKER_SECRET
  for role in "${roles[@]}"; do
    case "$role" in
      prefill) start_engine prefill "$PREFILL_HTTP" "$PREFILL_P2P" "${PREFILL_ENV:-}" "$PREFILL_WORKER_METRICS" \
                 "$PREFILL_HOST" ;;
      decode) start_engine decode "$DECODE_HTTP" "$DECODE_P2P" "${DECODE_ENV:-}" "$DECODE_WORKER_METRICS" \
                "$DECODE_HOST" ;;
      router)
        setsid "$VENV/bin/p2pworker" router --host "$ROUTER_HOST" --port "$ROUTER_PORT" \
          --prefill "http://$PREFILL_HOST:$PREFILL_HTTP,worker=$PREFILL_HOST:$PREFILL_P2P" \
          --decode "http://$DECODE_HOST:$DECODE_HTTP" > "$RUN_DIR/router.log" 2>&1 < /dev/null &
        echo $! > "$RUN_DIR/router.pid" ;;
    esac
  done
  ok=1
  for role in "${roles[@]}"; do
    case "$role" in
      prefill) wait_health prefill "http://$PREFILL_HOST:$PREFILL_HTTP/health" || { ok=0; break; } ;;
      decode) wait_health decode "http://$DECODE_HOST:$DECODE_HTTP/health" || { ok=0; break; } ;;
      router) wait_router "http://$ROUTER_HOST:$ROUTER_PORT/health" || { ok=0; break; } ;;
    esac
  done
  if [ $ok = 1 ]; then
    echo "pd.sh: up: ${roles[*]} (prefill http://$PREFILL_HOST:$PREFILL_HTTP, decode http://$DECODE_HOST:$DECODE_HTTP," \
      "router http://$ROUTER_HOST:$ROUTER_PORT; logs in $RUN_DIR)"
  else
    cmd_stop || true
    die "start failed (logs in $RUN_DIR)"
  fi
}

cmd_status() {
  local rc=0
  for role in prefill decode router; do
    if alive "$(pidof_role $role)"; then echo "$role: up (pid $(pidof_role $role))"; else echo "$role: down"; rc=1; fi
  done
  return $rc
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  restart-decode)  # stop the decode engine and start it again (the prefill engine and router stay up)
    [ -n "${MODEL:-}" ] || die "set MODEL"
    export P2PWORKER_SECRET=${P2PWORKER_SECRET:-$(cat "$RUN_DIR/secret")}
    stop_role decode
    start_engine decode "$DECODE_HTTP" "$DECODE_P2P" "${DECODE_ENV:-}" "$DECODE_WORKER_METRICS" "$DECODE_HOST"
    wait_health decode "http://$DECODE_HOST:$DECODE_HTTP/health" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
