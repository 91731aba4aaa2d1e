#!/usr/bin/env bash
# An interleaved A/B of two agentd builds on one durable store: each round
# runs the in-memory server of build A (the baseline), then the store on
# build A and on build B (every other round in the reverse order), each
# with `agentd bench` at 64 streams, agentd on core 0 and the client on
# core 1, as bench/store.sh does. Prints each round's events/s and, over
# the rounds, the medians of A/memory, B/memory and B/A (and the same for
# the followers' events with BENCH_FOLLOWERS).
#
#   bench/ab.sh OLD_AGENTD NEW_AGENTD                     # SQLite, bursty, 5 rounds
#   BENCH_WORKLOAD=one-at-a-time BENCH_ROUNDS=4 bench/ab.sh OLD NEW
#   BENCH_STORE=postgres://postgres@127.0.0.1:5432/test bench/ab.sh OLD NEW
#   BENCH_FOLLOWERS=1 bench/ab.sh OLD NEW                 # one Attach per Run
#
# Build the two binaries first (e.g. `cargo build --release` on each commit,
# copying target/release/agentd aside). The client is build B's (it must
# know --followers when BENCH_FOLLOWERS is set).
set -euo pipefail
cd "$(dirname "$0")/.."
if (($# != 2)); then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
old=$(realpath "$1") new=$(realpath "$2")
rounds=${BENCH_ROUNDS:-5}
workload=${BENCH_WORKLOAD:-bursty}
followers=${BENCH_FOLLOWERS:-0}
out=target/bench
mkdir -p "$out"
db=$out/ab.db
store=${BENCH_STORE:-sqlite://$db}
results=$out/ab.jsonl
rm -f "$results"
pin_s=() pin_c=()
if [[ $(nproc) -ge 2 ]] && command -v taskset >/dev/null; then
  pin_s=(taskset -c 0) pin_c=(taskset -c 1)
fi
export AGENTD_BENCH_SERVER_LOG=$out/ab-servers.log
rm -f "$AGENTD_BENCH_SERVER_LOG"
extra=()
if ((followers > 0)); then extra=(--followers "$followers"); fi
for round in $(seq "$rounds"); do
  order=("mem:$old" "a:$old" "b:$new")
  if ((round % 2 == 0)); then order=("b:$new" "a:$old" "mem:$old"); fi
  for o in "${order[@]}"; do
    name=${o%%:*} bin=${o#*:}
    rm -f "$db" "$db"-*
    s=$store
    if [[ $name == mem ]]; then s=memory:; fi
    "${pin_c[@]}" "$new" --log-format text bench --server-name "$name-$round" --target 127.0.0.1:50067 \
      --workload "$workload" --streams 64 --connections 8 --duration 4s --warmup 1s "${extra[@]}" \
      --json-out "$results" -- "${pin_s[@]}" "$bin" serve --stream-agent --default-agent stream \
      --listen 127.0.0.1:50067 --store "$s" --max-concurrent-runs 20000 --max-run-duration 300s \
      --shutdown-grace 310s --drain-delay 0s --admin-listen off --a2a-listen off >/dev/null \
      || echo "bench/ab.sh: FAILED $name (round $round)" >&2
  done
done
rm -f "$db" "$db"-*
python3 - "$results" "$store" "$workload" <<'PY'
import collections, json, statistics, sys
results, store, workload = sys.argv[1:]
rounds = collections.defaultdict(dict)
for line in open(results):
    r = json.loads(line)
    name, rnd = r["server"].rsplit("-", 1)
    rounds[int(rnd)][name] = (r["events_per_second"], r.get("follower_events_per_second") or 0.0)
print(f"{store.split(':')[0]}, {workload}, 64 streams; A = the first build, B = the second")
for rnd in sorted(rounds):
    d = rounds[rnd]
    print(f"round {rnd}: " + ", ".join(f"{k} {v[0] / 1000:.0f} k/s" for k, v in sorted(d.items())))
for label, i in (("events", 0), ("follower events", 1)):
    full = [d for d in rounds.values() if all(k in d and d[k][i] > 0 for k in ("mem", "a", "b"))]
    if not full:
        continue
    med = lambda f: statistics.median(f(d) for d in full)
    print(f"{label}: A/memory {med(lambda d: d['a'][i] / d['mem'][i]):.3f}x, "
          f"B/memory {med(lambda d: d['b'][i] / d['mem'][i]):.3f}x, "
          f"B/A {med(lambda d: d['b'][i] / d['a'][i]):.3f}x "
          f"(medians of {len(full)} rounds)")
PY
