#!/usr/bin/env bash
# Reruns every benchmark script; each rewrites its own section of benchmarks/RESULTS.md.
# Usage: benchmarks/run_all.sh [PYTHON]   (default: python). Run from any directory.
# Timing benchmarks (bw_split, step_time, compile_time) report ratios measured within one
# process, but on a loaded machine the absolute times and the noise grow: run on a quiet one.
# gpu.py runs only on a GPU machine; elsewhere it says so and is skipped.
set -u
PYTHON="${1:-python}"
cd "$(dirname "$0")/.."
failed=()
run() {
  echo "=== $* ($(date -u +%H:%M:%S) UTC; $(uptime | sed 's/.*load/load/'))"
  if ! "$PYTHON" "$@"; then failed+=("$*"); fi
}
run benchmarks/schedules.py
run benchmarks/lockstep.py
if [ -f benchmarks/graphpipe.py ]; then run benchmarks/graphpipe.py; fi
run benchmarks/bw_split.py
run benchmarks/bw_in_step.py
run benchmarks/slot_writes.py
run benchmarks/stash_reads.py
run benchmarks/memory.py
run benchmarks/compile_time.py
run benchmarks/build_time.py
run benchmarks/optimizer.py
run benchmarks/tensor_parallel.py
run benchmarks/step_time.py
run benchmarks/buffers.py
run benchmarks/in_context.py
run benchmarks/multiprocess.py
run benchmarks/overlap.py
if "$PYTHON" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  run benchmarks/gpu.py
else
  echo "=== benchmarks/gpu.py skipped: no GPU backend"
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all benchmarks done; see benchmarks/RESULTS.md"
