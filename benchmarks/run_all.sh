#!/usr/bin/env bash
# Reruns every benchmark script; each rewrites its own section of benchmarks/RESULTS.md.
# Each runs with the flags its section says it was made with (tests/test_benchmarks_smoke.py
# checks that they agree), so this reproduces the published commands.
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
run benchmarks/auto_ticks.py
if [ -f benchmarks/graphpipe.py ]; then run benchmarks/graphpipe.py; fi
run benchmarks/bw_split.py --repeats 41
run benchmarks/bw_in_step.py --rounds 11 --seconds 60 --profiles 2
run benchmarks/slot_writes.py --repeats 11
run benchmarks/stash_reads.py --repeats 21
run benchmarks/memory.py --microbatches 4 8 16
run benchmarks/balance.py --repeats 21
run benchmarks/compile_time.py --repeats 3
run benchmarks/compile_layers.py --layers 8 32 128 --repeats 3
run benchmarks/build_time.py --repeats 3 --layers 8 16 32 48
run benchmarks/optimizer.py --rounds 21
run benchmarks/evaluation.py --rounds 11
run benchmarks/tensor_parallel.py --rounds 11
run benchmarks/step_time.py --rounds 21 --microbatches 4 8 16
run benchmarks/buffers.py --rounds 41
run benchmarks/in_context.py --repeats 5 --steps 5
run benchmarks/multiprocess.py --rounds 41 --microbatches 4 8
run benchmarks/overlap.py --rounds 21
run benchmarks/multiprocess_unstage.py --runs 3 --steps 40
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
