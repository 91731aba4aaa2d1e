#!/usr/bin/env bash
# What starting a model call beside the turn's claim changes: the
# model-overhead benchmark (64 concurrent runs of 256 tokens, agentd pinned
# to core 0, the fake model and the clients to core 1) with agentd as it is
# and with `--claim-first`, taking turns, on SQLite and on PostgreSQL, for a
# model that answers at once and for one that thinks 50 ms before its first
# token. Prints, per case, the median over the rounds of TTFT added by
# agentd (p50, ms) and of the TTLT ratio agentd/direct (p50).
#
#   bench/claim_first.sh                 # AGENTD_BENCH_POSTGRES_URL, default postgres://postgres@127.0.0.1:5432/test
#   BENCH_ROUNDS=1 bench/claim_first.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${BENCH_ROUNDS:-3}
out=target/bench
mkdir -p "$out"
postgres_url=${AGENTD_BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
export PGOPTIONS='-c client_min_messages=warning'
cargo build --release --locked --bin agentd --example model_overhead
dir=${CARGO_TARGET_DIR:-target}/release
db=$out/claim-first.db
stores=("sqlite://$db")
if command -v pg_isready >/dev/null && pg_isready -q -d "$postgres_url"; then stores+=("$postgres_url"); fi
results=$out/claim-first.tsv
: >"$results"
for store in "${stores[@]}"; do
  for ttft in 0s 50ms; do
    for round in $(seq "$rounds"); do
      order=(0 1)
      if ((round % 2 == 0)); then order=(1 0); fi
      for claim_first in "${order[@]}"; do
        rm -f "$db" "$db"-*
        url=$store
        if [[ $store == postgres* ]]; then
          # A database of its own, made afresh for each run.
          url=${store%/*}/agentd_claim_first_bench
          psql -q "${store%/*}/postgres" -c "DROP DATABASE IF EXISTS agentd_claim_first_bench" \
            -c "CREATE DATABASE agentd_claim_first_bench" >/dev/null
        fi
        line=$("$dir/examples/model_overhead" tokens=256 concurrency=64 rounds=10 agentd="$dir/agentd" pin=1 \
          store="$url" ttft="$ttft" claim_first="$claim_first" 2>&1 | grep -E 'TTLT ratio|TTFT added' | tr '\n' ' ') || true
        ratio=$(sed -nE 's/.*TTLT ratio agentd\/direct \(p50\): ([0-9.]+).*/\1/p' <<<"$line")
        added=$(sed -nE 's/.*TTFT added by agentd \(p50\): (-?[0-9.]+) ms.*/\1/p' <<<"$line")
        if [[ -z $ratio || -z $added ]]; then
          echo "bench/claim_first.sh: FAILED ${store%%:*} ttft=$ttft claim_first=$claim_first (round $round)" >&2
          continue
        fi
        printf '%s\t%s\t%s\t%s\t%s\n' "${store%%:*}" "$ttft" "$claim_first" "$added" "$ratio" >>"$results"
      done
    done
  done
done
rm -f "$db" "$db"-*
if [[ ${#stores[@]} -gt 1 ]]; then
  psql -q "${postgres_url%/*}/postgres" -c "DROP DATABASE IF EXISTS agentd_claim_first_bench" >/dev/null
fi
python3 - "$results" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines() if l]
cases = {}
for store, ttft, cf, added, ratio in rows:
    cases.setdefault((store, ttft, cf), []).append((float(added), float(ratio)))
print("| store | model's own TTFT | agentd | runs | TTFT added p50 (ms) | TTLT ratio p50 |")
print("| --- | --- | --- | ---: | ---: | ---: |")
for (store, ttft, cf), v in sorted(cases.items()):
    mode = "--claim-first" if cf == "1" else "model call beside the claim"
    print(f"| {store} | {ttft} | {mode} | {len(v)} | {statistics.median(a for a, _ in v):.2f} "
          f"| {statistics.median(r for _, r in v):.3f} |")
PY
