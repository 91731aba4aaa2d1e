#!/usr/bin/env bash
# What the durable store costs, and nothing else: agentd on the in-memory
# store against the same agentd on SQLite and on PostgreSQL, bursty and
# one-at-a-time workloads at 1 and 64 streams, pinned like bench/run.sh
# (server on core 0, client on core 1). The stores take turns, round by
# round (every other round in the reverse order), so each ratio is against
# a baseline run seconds before or after it. The table gives each store's
# median events/s over the rounds and the median (and range) of each
# round's ratio to the in-memory store. PostgreSQL's own processes are
# moved to the client's core for the run, as if on a machine of their own
# (bench/postgres_core.sh; BENCH_POSTGRES_CORE=shared leaves them be).
#
#   bench/store.sh                       # AGENTD_BENCH_POSTGRES_URL, default postgres://postgres@127.0.0.1:5432/test
#   BENCH_DURATION=2s BENCH_ROUNDS=1 bench/store.sh
#   BENCH_POSTGRES_CORE=shared bench/store.sh
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${BENCH_DURATION:-4s}
rounds=${BENCH_ROUNDS:-5}
out=target/bench
mkdir -p "$out"
# One file per round, so a run that fails leaves its round's ratio out
# instead of pairing later rounds wrongly.
rm -f "$out"/store-round-*.jsonl
postgres_url=${AGENTD_BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
cargo build --release --locked --bin agentd
bin=${CARGO_TARGET_DIR:-target}/release/agentd
pin_s=() pin_c=()
pinning="not pinned (fewer than 2 cores or no taskset)"
if [[ $(nproc) -ge 2 ]] && command -v taskset >/dev/null; then
  pin_s=(taskset -c 0) pin_c=(taskset -c 1) pinning="agentd on core 0, the client on core 1"
fi
db=$out/store-bench.db
# The servers' own logs (why one did not start, say) go beside the client's.
export AGENTD_BENCH_SERVER_LOG=$out/store-servers.log
rm -f "$AGENTD_BENCH_SERVER_LOG"
stores=(memory: "sqlite://$db")
# shellcheck source=bench/postgres_core.sh
source bench/postgres_core.sh
if command -v pg_isready >/dev/null && pg_isready -q -d "$postgres_url"; then
  stores+=("$postgres_url")
  # Off the server's core, with the client (see bench/postgres_core.sh).
  if ((${#pin_s[@]} > 0)); then
    postgres_to_core 1
    pinning="$pinning; $postgres_placement"
  fi
fi
for w in bursty one-at-a-time; do
  for n in 1 64; do
    conns=$((n >= 8 ? 8 : n))
    for round in $(seq "$rounds"); do
      # Every other round runs the stores in the reverse order, so a machine
      # whose speed drifts during a round favours no store.
      order=("${stores[@]}")
      if ((round % 2 == 0)); then
        order=()
        for ((i = ${#stores[@]} - 1; i >= 0; i--)); do order+=("${stores[i]}"); done
      fi
      for store in "${order[@]}"; do
        rm -f "$db" "$db"-*
        name=${store%%:*}
        "${pin_c[@]}" "$bin" --log-format text bench --server-name "$name" --target 127.0.0.1:50066 \
          --workload "$w" --streams "$n" --connections "$conns" --duration "$duration" --warmup 1s \
          --json-out "$out/store-round-$round.jsonl" -- "${pin_s[@]}" "$bin" serve --stream-agent --default-agent stream --listen 127.0.0.1:50066 \
          --store "$store" --max-concurrent-runs 20000 --max-run-duration 300s --shutdown-grace 310s --drain-delay 0s \
          --admin-listen off --a2a-listen off >/dev/null 2>>"$out/store-servers.log" \
          || echo "bench/store.sh: FAILED $name $w $n (round $round)" >&2
      done
    done
  done
done
rm -f "$db" "$db"-*
python3 - "$out" "$rounds" "$pinning" <<'PY'
import json, statistics, sys
out, rounds, pinning = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# (server, workload, streams) -> {round: events/s}
runs = {}
for rnd in range(1, rounds + 1):
    try:
        lines = open(f"{out}/store-round-{rnd}.jsonl").read().splitlines()
    except FileNotFoundError:
        continue
    for l in lines:
        r = json.loads(l)
        runs.setdefault((r["server"], r["workload"], r["streams"]), {})[rnd] = r["events_per_second"]
print(f"{rounds} round(s); events/s are medians over the rounds, ratios the median of each round's ratio")
print(pinning)
print("| workload | streams | memory events/s | SQLite events/s | PostgreSQL events/s | SQLite / memory | PostgreSQL / memory |")
print("|---|---:|---:|---:|---:|---:|---:|")
goals = []
for w in ("bursty", "one-at-a-time"):
    for n in (1, 64):
        m, s, p = (runs.get((k, w, n), {}) for k in ("memory", "sqlite", "postgres"))
        f = lambda xs: f"{statistics.median(xs.values())/1e3:.1f} k" if xs else "–"
        def ratios(xs):
            return [xs[k] / m[k] for k in xs if m.get(k)]
        def r(xs):
            pairs = ratios(xs)
            if not pairs:
                return "–"
            lo, hi = min(pairs), max(pairs)
            spread = f" ({lo:.2f}–{hi:.2f})" if len(pairs) > 1 else ""
            return f"{statistics.median(pairs):.2f}×{spread}"
        print(f"| {w} | {n} | {f(m)} | {f(s)} | {f(p)} | {r(s)} | {r(p)} |")
        if n == 64:
            for name, xs in (("SQLite", s), ("PostgreSQL", p)):
                pairs = ratios(xs)
                if pairs:
                    med = statistics.median(pairs)
                    goals.append(f"{name}, {w}, 64 streams: {med:.2f}× memory (target ≥ 0.80×: {'met' if med >= 0.8 else 'NOT met'})")
print()
print("\n".join(goals))
PY
