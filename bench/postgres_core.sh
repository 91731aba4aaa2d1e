# Sourced by the benchmark scripts: where PostgreSQL's processes run while
# agentd is measured on its own core.
#
# In a deployment PostgreSQL has a machine of its own. On a benchmark
# machine it is one more set of processes, and left where the kernel puts
# them, they take CPU from the core the server is pinned to: the PostgreSQL
# rows would then charge the database's own work (parsing, WAL, TOAST
# compression, checkpoints) to agentd. So, by default, its processes are
# moved to the client's core for the run, and put back when the script
# exits. BENCH_POSTGRES_CORE=shared leaves them where they are.
#
# postgres_to_core CORE: moves the postmaster and every process it has
# started (new ones inherit the postmaster's CPUs) to CORE, remembering
# where each was. Sets `postgres_placement` to a sentence for the report.
# Needs taskset and the right to move those processes (root, or the
# database's own user); without either they stay shared, and the report
# says so.

postgres_moved=()
postgres_placement="PostgreSQL's processes not moved (BENCH_POSTGRES_CORE=shared)"

postgres_to_core() {
  local core=$1 pid mask
  case ${BENCH_POSTGRES_CORE:-client} in
    shared) return ;;
    client) ;;
    *)
      echo "BENCH_POSTGRES_CORE must be client (the default) or shared, not ${BENCH_POSTGRES_CORE}" >&2
      exit 2
      ;;
  esac
  postgres_placement="PostgreSQL's processes share the server's core (they could not be moved)"
  command -v taskset >/dev/null && command -v pgrep >/dev/null || return 0
  local pids
  pids=$(pgrep -x postgres || true)
  [[ -n $pids ]] || return 0
  for pid in $pids; do
    mask=$(taskset -p "$pid" 2>/dev/null | awk '{print $NF}') || continue
    [[ -n $mask ]] || continue
    if taskset -a -p -c "$core" "$pid" >/dev/null 2>&1; then
      postgres_moved+=("$pid:$mask")
    fi
  done
  if ((${#postgres_moved[@]} > 0)); then
    postgres_placement="PostgreSQL's processes on core $core, with the client (as on a machine of their own)"
  fi
  trap postgres_restore EXIT
}

postgres_restore() {
  local entry
  for entry in "${postgres_moved[@]}"; do
    taskset -a -p "${entry#*:}" "${entry%%:*}" >/dev/null 2>&1 || true
  done
  postgres_moved=()
}
