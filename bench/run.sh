#!/usr/bin/env bash
# Runs the streaming benchmarks and regenerates the "Streaming" block of
# BENCHMARKS.md: agentd, a raw tonic server (examples/raw_stream.rs) and a
# Python grpc.aio server (bench/python/server.py), side by side, in one run,
# all driven by the same client (`agentd bench`) over loopback.
#
#   bench/run.sh                 # everything, a few minutes
#   BENCH_DURATION=2s bench/run.sh   # shorter windows (noisier)
#   BENCH_ONLY=agentd,tonic bench/run.sh   # a subset of the servers
#   BENCH_STORES=0 bench/run.sh  # without the durable-store rows (SQLite, and
#                                # PostgreSQL at AGENTD_BENCH_POSTGRES_URL when it answers,
#                                # its processes moved to the client's core: bench/postgres_core.sh)
#
# Each workload starts a fresh server (so RSS readings are its own), pinned
# to core 0 with the client on core 1 when the machine has two or more
# cores. Not part of CI's test run; CI only builds the code.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'bench/run.sh: %s\n' "$*" >&2; }

nice_level=${BENCH_NICE:--15}
if [[ -z ${BENCH_AUTOGROUP_NICE:-} && $nice_level != 0 && -w /proc/self/autogroup ]] && command -v setsid >/dev/null; then
  # Re-run in a new session, then raise that session's scheduling weight.
  exec setsid --wait env BENCH_AUTOGROUP_NICE="$nice_level" bash "$0" "$@"
fi
if [[ -n ${BENCH_AUTOGROUP_NICE:-} ]]; then
  echo "$BENCH_AUTOGROUP_NICE" > /proc/self/autogroup 2>/dev/null || BENCH_AUTOGROUP_NICE=
fi

duration=${BENCH_DURATION:-4s}
warmup=${BENCH_WARMUP:-1s}
paced_duration=${BENCH_PACED_DURATION:-10s}
idle_streams=${BENCH_IDLE_STREAMS:-10000}
only=${BENCH_ONLY:-agentd,tonic,grpc.aio}
out=target/bench
results=$out/results.jsonl
mkdir -p "$out"
: > "$results"
: > "$out/servers.log"

# The Python peer, its generated code, and the plotting library.
venv=bench/python/.venv
if [[ ! -x $venv/bin/python ]]; then
  log "creating $venv"
  python3 -m venv "$venv"
fi
stamp=$venv/.requirements.sha
want=$(sha256sum bench/python/requirements.txt | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  log "installing bench/python/requirements.txt into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r bench/python/requirements.txt
  echo "$want" > "$stamp"
fi
rm -rf "$out/py" && mkdir -p "$out/py"
"$venv/bin/python" -m grpc_tools.protoc -Iproto --python_out="$out/py" --grpc_python_out="$out/py" proto/agents/v1/agent.proto

log "building (release)"
cargo build --release --locked --bin agentd --example raw_stream
bin=${CARGO_TARGET_DIR:-target}/release

if [[ $(nproc) -ge 2 ]] && command -v taskset >/dev/null; then
  server_pin=(taskset -c 0)
  client_pin=(taskset -c 1)
  pinning="server on core 0, client on core 1 (taskset)"
else
  server_pin=()
  client_pin=()
  pinning="not pinned (fewer than 2 cores or no taskset)"
fi
# On a shared machine, give the measured processes priority over other work:
# the kernel schedules by session ("autogroup"), so the run gets a session of
# its own (see the top of this script) whose weight is raised (root only;
# BENCH_NICE=0 turns it off).
if [[ -n ${BENCH_AUTOGROUP_NICE:-} ]]; then
  pinning="$pinning, in a scheduling group at nice $BENCH_AUTOGROUP_NICE"
fi
echo "$pinning" > "$out/pinning.txt"

agentd_serve=("$bin/agentd" serve --stream-agent --default-agent stream
  --max-concurrent-runs 20000 --max-run-duration 300s --shutdown-grace 310s --drain-delay 0s
  --admin-listen off --a2a-listen off)
declare -A port=([agentd]=50061 [tonic]=50062 [grpc.aio]=50063 [agentd+sqlite]=50064 [agentd+postgres]=50065)
sqlite_db=$out/bench.db
postgres_url=${AGENTD_BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}

server_cmd() {
  case $1 in
    agentd) echo "${agentd_serve[@]}" --listen 127.0.0.1:50061 --store memory: ;;
    agentd+sqlite) echo "${agentd_serve[@]}" --listen 127.0.0.1:50064 --store "sqlite://$sqlite_db" ;;
    agentd+postgres) echo "${agentd_serve[@]}" --listen 127.0.0.1:50065 --store "$postgres_url" ;;
    tonic) echo "$bin/examples/raw_stream" 127.0.0.1:50062 ;;
    grpc.aio) echo "$venv/bin/python" bench/python/server.py 127.0.0.1:50063 "$out/py" ;;
  esac
}

servers=()
for s in agentd tonic grpc.aio; do
  [[ ,$only, == *,$s,* ]] && servers+=("$s")
done
# The durable stores: what persistence costs, against agentd on memory.
store_servers=()
if [[ ,$only, == *,agentd,* && ${BENCH_STORES:-1} != 0 ]]; then
  store_servers+=("agentd+sqlite")
  if command -v pg_isready >/dev/null && pg_isready -q -d "$postgres_url" 2>/dev/null; then
    store_servers+=("agentd+postgres")
    # Off the server's core, with the client (see bench/postgres_core.sh).
    if ((${#server_pin[@]} > 0)); then
      # shellcheck source=bench/postgres_core.sh
      source bench/postgres_core.sh
      postgres_to_core 1
      pinning="$pinning; $postgres_placement"
      echo "$pinning" > "$out/pinning.txt"
    fi
  else
    log "no PostgreSQL at $postgres_url: skipping the PostgreSQL rows"
  fi
fi

# bench SERVER WORKLOAD STREAMS CONNECTIONS [extra agentd-bench flags...]
bench() {
  local name=$1 workload=$2 streams=$3 conns=$4
  shift 4
  [[ $name == agentd+sqlite ]] && rm -f "$sqlite_db" "$sqlite_db"-*
  # shellcheck disable=SC2046
  AGENTD_BENCH_SERVER_LOG=$out/servers.log "${client_pin[@]}" "$bin/agentd" --log-format text bench \
    --server-name "$name" --target "127.0.0.1:${port[$name]}" --workload "$workload" \
    --streams "$streams" --connections "$conns" --warmup "$warmup" --json-out "$results" "$@" \
    -- "${server_pin[@]}" $(server_cmd "$name") \
    || log "FAILED: $name $workload streams=$streams"
}

conns_for() { if (($1 >= 8)); then echo 8; else echo "$1"; fi; }

for s in "${servers[@]}"; do
  log "=== $s"
  for n in 1 64; do bench "$s" bursty "$n" "$(conns_for "$n")" --duration "$duration"; done
  for n in 1 4 16 64; do bench "$s" one-at-a-time "$n" "$(conns_for "$n")" --duration "$duration"; done
  for n in 1 64; do bench "$s" short "$n" "$(conns_for "$n")" --duration "$duration"; done
  for n in 1 16; do bench "$s" paced "$n" "$(conns_for "$n")" --duration "$duration" --rate 1000; done
  bench "$s" paced 64 8 --duration "$paced_duration" --rate 1000
  bench "$s" idle "$idle_streams" 16 --idle-wait 120s --settle 2s
done

for s in "${store_servers[@]}"; do
  log "=== $s"
  for n in 1 64; do bench "$s" bursty "$n" "$(conns_for "$n")" --duration "$duration"; done
  for n in 1 64; do bench "$s" one-at-a-time "$n" "$(conns_for "$n")" --duration "$duration"; done
  for n in 1 64; do bench "$s" short "$n" "$(conns_for "$n")" --duration "$duration"; done
  bench "$s" paced 64 8 --duration "$paced_duration" --rate 1000
done
rm -f "$sqlite_db" "$sqlite_db"-*

log "writing BENCHMARKS.md and bench/streams.png"
"$venv/bin/python" bench/report.py "$results" BENCHMARKS.md bench/streams.png \
  --command "bench/run.sh" --pinning "$pinning"
