"""Unstaging over two processes: one jitted program against the eager slices it replaced.

Over several processes every eager JAX op on an array spanning them is a program every process
must run. ``pipe.unstage`` used to slice rows over both processes eagerly, a few programs per
param leaf, and in a loop of steps that each unstage their grads those queued up and stalled
XLA:CPU's collectives across the processes (a hang; the CI of session 44 hung in
``tests/test_multiprocess.py`` this way). It now runs one jitted program. This script runs two
processes joined by ``jax.distributed`` over gloo, each with 2 CPU devices (a pp=2 x data=2
mesh, data across the processes), ``models/mlp``'s MLP with zb-h2, for ``--steps`` steps that
each unstage their grads and then read the loss (as on fake CPU devices a loop must at least
every 16 steps or so: README, known limits); the variants, alternating run by
run: ``pipe.unstage`` (one program) and the same rows sliced eagerly as before
(``zbjax.params.unstage_leaves`` on them outside ``jax.jit``). A pair still running after
``HANG_S`` seconds prints its stacks and stops: counted as hung. Writes the section
"multiprocess_unstage" of ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/multiprocess_unstage.py [--runs 5] [--steps 40]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

COMMAND = "python benchmarks/multiprocess_unstage.py"
VARIANTS = ("one program", "eager slices")
NUM_PROCESSES = 2
#: A worker still running after this many seconds dumps its stacks and exits (hung).
HANG_S = 90


def worker(process_id: int, port: int, variant: str, steps: int, out: str) -> None:
    """One process: the steps of ``variant``; process 0 writes the loop's seconds to ``out``."""
    import faulthandler

    faulthandler.dump_traceback_later(HANG_S, exit=True)
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=process_id
    )
    import numpy as np
    from jax.sharding import Mesh

    import zbjax
    from models import mlp
    from zbjax.params import unstage_leaves

    cfg = mlp.MLPConfig(in_dim=8, width=16, depth=4, out_dim=8, stage_boundaries=())
    loss_fn = mlp.make_loss_fn(cfg)
    params = jax.tree.map(np.asarray, mlp.init_params(jax.random.key(0), cfg))
    batch = jax.tree.map(np.asarray, mlp.make_batch(jax.random.key(1), cfg, 32))
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2).T, ("pp", "data"))
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=4)
    staged = pipe.stage(params, batch)
    began = time.perf_counter()
    for _ in range(steps):
        loss, grads = pipe.value_and_grad(staged, batch)
        if variant == "one program":
            pipe.unstage(grads)
        else:
            unstage_leaves(pipe.lowering.layout, grads)
        float(loss)
    seconds = time.perf_counter() - began
    if process_id == 0:
        Path(out).write_text(json.dumps({"seconds": seconds}))


def run_pair(variant: str, steps: int) -> float | None:
    """Returns the seconds of the steps in process 0, or None when the pair hung or failed."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import free_port

    here = Path(__file__).resolve()
    paths = [str(here.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        port = str(free_port())
        logs = [open(Path(tmp) / f"worker{i}.log", "w") for i in range(NUM_PROCESSES)]  # noqa: SIM115
        procs = [
            subprocess.Popen(
                [sys.executable, str(here), "--worker", str(i), "--port", port, "--out", str(out)]
                + ["--variant", variant, "--steps", str(steps)],
                env=env,
                stdout=logs[i],
                stderr=subprocess.STDOUT,
            )
            for i in range(NUM_PROCESSES)
        ]
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=HANG_S + 60))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                codes.append(-9)
        for log in logs:
            log.close()
        if any(codes) or not out.exists():
            tail = (Path(tmp) / "worker0.log").read_text()[-1500:]
            print(f"{variant}: the processes exited with {codes}; process 0's log ends:\n{tail}")
            return None
        return json.loads(out.read_text())["seconds"]


def run(runs: int, steps: int, variants: Sequence[str] = VARIANTS) -> dict[str, list[float | None]]:
    """Returns each variant's seconds per run (None: hung), the variants alternating."""
    results: dict[str, list[float | None]] = {v: [] for v in variants}
    for _ in range(runs):
        for variant in variants:
            results[variant].append(run_pair(variant, steps))
    return results


def section(results: dict[str, list[float | None]], runs: int, steps: int, took: float) -> str:
    """Returns the markdown of the "multiprocess_unstage" section."""
    from _results import machine_load

    lines = [
        "## Unstaging over two processes: one program against eager slices",
        "",
        f"Made by `{COMMAND} --runs {runs} --steps {steps}`: 2 processes of 2 CPU devices "
        "joined by `jax.distributed` (gloo), a pp=2 x data=2 mesh with the data axis across "
        f"them, `models/mlp`'s MLP with zb-h2, {steps} steps that each unstage their grads "
        "and then read the loss; the variants alternate run by run. one program = "
        "`pipe.unstage` (one jitted program); eager slices = the rows sliced eagerly as "
        "`pipe.unstage` did before (`zbjax.params.unstage_leaves` outside `jax.jit`). A run "
        f"hangs when its processes are still running after {HANG_S} s (they print their stacks "
        "and stop). seconds = the steps' time in process 0, median over the runs that "
        f"finished. Took {took:.0f} s; {machine_load()}.",
        "",
        "| variant | runs | hung | seconds (median of finished) |",
        "|---|---:|---:|---:|",
    ]
    for variant, seconds in results.items():
        done = [s for s in seconds if s is not None]
        median = f"{statistics.median(done):.2f}" if done else "-"
        lines.append(f"| {variant} | {len(seconds)} | {len(seconds) - len(done)} | {median} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variant", choices=VARIANTS, default=VARIANTS[0])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_worker_flags

    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.port, args.variant, args.steps, args.out)
        return 0
    began = time.perf_counter()
    results = run(args.runs, args.steps)
    body = section(results, args.runs, args.steps, time.perf_counter() - began)
    print(body)
    if args.smoke:
        print("--smoke: not writing RESULTS.md")
        return 0
    from _results import write_section

    print(f"wrote {write_section('multiprocess_unstage', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
