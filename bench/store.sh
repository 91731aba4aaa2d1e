#!/usr/bin/env bash
# What the durable store costs, and nothing else: agentd on the in-memory
# store against the same agentd on SQLite and on PostgreSQL, bursty and
# one-at-a-time workloads at 1 and 64 streams, in one run, pinned like
# bench/run.sh (server on core 0, client on core 1). Prints the ratios.
#
#   bench/store.sh                       # AGENTD_BENCH_POSTGRES_URL, default postgres://postgres@127.0.0.1:5432/test
#   BENCH_DURATION=2s bench/store.sh
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${BENCH_DURATION:-4s}
out=target/bench
mkdir -p "$out"
results=$out/store.jsonl
: > "$results"
postgres_url=${AGENTD_BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
cargo build --release --locked --bin agentd
bin=${CARGO_TARGET_DIR:-target}/release/agentd
pin_s=() pin_c=()
if [[ $(nproc) -ge 2 ]] && command -v taskset >/dev/null; then pin_s=(taskset -c 0); pin_c=(taskset -c 1); fi
db=$out/store-bench.db
stores=(memory: "sqlite://$db")
if command -v pg_isready >/dev/null && pg_isready -q -d "$postgres_url"; then stores+=("$postgres_url"); fi
for w in bursty one-at-a-time; do
  for n in 1 64; do
    conns=$((n >= 8 ? 8 : n))
    for store in "${stores[@]}"; do
      rm -f "$db" "$db-wal" "$db-shm"
      name=${store%%:*}
      "${pin_c[@]}" "$bin" --log-format text bench --server-name "$name" --target 127.0.0.1:50066 \
        --workload "$w" --streams "$n" --connections "$conns" --duration "$duration" --warmup 1s \
        --json-out "$results" -- "${pin_s[@]}" "$bin" serve --default-agent stream --listen 127.0.0.1:50066 \
        --store "$store" --max-concurrent-runs 20000 --max-run-duration 300s --shutdown-grace 310s --drain-delay 0s \
        --admin-listen off --a2a-listen off >/dev/null 2>>"$out/store-servers.log" \
        || echo "bench/store.sh: FAILED $name $w $n" >&2
    done
  done
done
rm -f "$db" "$db-wal" "$db-shm"
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ev = {(r["server"], r["workload"], r["streams"]): r["events_per_second"] for r in rows}
print("| workload | streams | memory events/s | SQLite events/s | PostgreSQL events/s | SQLite / memory | PostgreSQL / memory |")
print("|---|---:|---:|---:|---:|---:|---:|")
for w in ("bursty", "one-at-a-time"):
    for n in (1, 64):
        m, s, p = (ev.get((k, w, n)) for k in ("memory", "sqlite", "postgres"))
        f = lambda x: f"{x/1e3:.1f} k" if x else "–"
        r = lambda x: f"{x/m:.2f}×" if x and m else "–"
        print(f"| {w} | {n} | {f(m)} | {f(s)} | {f(p)} | {r(s)} | {r(p)} |")
PY
