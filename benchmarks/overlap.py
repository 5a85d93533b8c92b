"""Does a tick's exchange overlap compute that does not depend on it, on XLA:CPU?

The lowering ends every tick that sends with a ``ppermute`` of what the tick's actions just
produced, and the next tick reads it. Overlapping the exchange with compute would need the
message to leave while independent work runs, and arrive a tick later. Before building that,
this script asks whether XLA:CPU would overlap them at all: two processes, each pinned to its
own core with one CPU device and joined by ``jax.distributed`` (gloo), as in
``multiprocess.py``, time per tick of a ``lax.scan`` inside ``shard_map`` whose body

- *compute then send*: computes a message (``LAYERS`` Dense(128) + tanh on 1024 rows, about a
  pipeline stage's forward in ``step_time``) and ``ppermute``-s it; the next tick computes on
  what arrived;
- *send beside compute*: ``ppermute``-s the previous tick's message while computing the next
  from data that does not depend on it (the message arrives a tick later);
- *compute only* and *send only*: each part alone.

Were the exchange overlapped, *send beside compute* would take about the larger of the two
parts; run one after the other, their sum. The variants alternate round by round. Writes the
section "overlap" of ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/overlap.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

COMMAND = "python benchmarks/overlap.py"
NUM_PROCESSES = 2
TICKS = 16
LAYERS = 6
ROWS, WIDTH = 1024, 128
VARIANTS = ("compute then send", "send beside compute", "compute only", "send only")
TIMEOUT_S = 600


def worker(process_id: int, port: int, rounds: int, out: str, smoke: bool) -> None:
    """Runs one process: pins it to core ``process_id``, joins the other, times the loops."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[process_id]})
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=process_id
    )
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    rows, width = (8, 8) if smoke else (ROWS, WIDTH)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("pp",))
    perm = [(d, (d + 1) % NUM_PROCESSES) for d in range(NUM_PROCESSES)]
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(LAYERS, width, width)) * 0.1)

    def compute(h):
        for layer in range(LAYERS):
            h = jnp.tanh(h @ weights[layer])
        return h

    def send(h):
        return jax.lax.ppermute(h, "pp", perm)

    def compute_then_send(x):
        return jax.lax.scan(lambda h, _: (send(compute(h)), None), x, None, length=TICKS)[0]

    def send_beside_compute(x):
        def tick(carry, _):
            message, h = carry
            arrived = send(message)  # the previous tick's message
            h = compute(h)  # independent of what arrives this tick
            return (h, arrived + h), None  # the arrival is used a tick later

        return jax.lax.scan(tick, (x, x), None, length=TICKS)[0][1]

    def compute_only(x):
        return jax.lax.scan(lambda h, _: (compute(h), None), x, None, length=TICKS)[0]

    def send_only(x):
        return jax.lax.scan(lambda h, _: (send(h), None), x, None, length=TICKS)[0]

    bodies = (compute_then_send, send_beside_compute, compute_only, send_only)
    spec = PartitionSpec("pp")
    steps = {
        name: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        for name, body in zip(VARIANTS, bodies, strict=True)
    }
    x = jax.make_array_from_callback(
        (NUM_PROCESSES * rows, width),
        NamedSharding(mesh, spec),
        lambda index: np.ones((rows, width), np.float32),
    )
    for step in steps.values():  # compile, warm up
        for _ in range(3):
            jax.block_until_ready(step(x))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        names = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in names:
            began = time.perf_counter()
            jax.block_until_ready(steps[name](x))
            times[name].append((time.perf_counter() - began) / TICKS)
    if process_id == 0:
        Path(out).write_text(json.dumps(times))


def section(times: dict[str, list[float]], rounds: int, took: float) -> str:
    """Returns the markdown of the "overlap" section."""
    from _results import machine_load

    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    compute, sent = ms["compute only"], ms["send only"]
    lines = [
        "## Exchange beside independent compute on XLA:CPU (two pinned processes)",
        "",
        f"Made by `{COMMAND} --rounds {rounds}`: 2 processes, each pinned to its own core with "
        "one CPU device, joined by `jax.distributed` (gloo over TCP). Each step is a `lax.scan` "
        f"of {TICKS} ticks inside `shard_map`; a tick computes {LAYERS} Dense({WIDTH}) + tanh "
        f"on {ROWS} rows and `ppermute`-s a {ROWS} x {WIDTH} float32 message to the other "
        "process. *compute then send*: the message is what the tick computed, as the lowering "
        "sends; *send beside compute*: the previous tick's message travels while the tick "
        "computes from data that does not depend on it. Times are per tick, medians over "
        f"{rounds} alternating rounds.",
        "",
        "| variant | ms per tick |",
        "|---|---|",
        *(f"| {name} | {ms[name]:.3f} |" for name in VARIANTS),
        "",
        f"Overlapped, *send beside compute* would take about max(compute, send) = "
        f"{max(compute, sent):.3f} ms; one after the other, compute + send = "
        f"{compute + sent:.3f} ms. It took {ms['send beside compute']:.3f} ms, "
        f"{ms['send beside compute'] / ms['compute then send']:.3f}x *compute then send*.",
        "",
        f"Machine load at the end: `{machine_load()}`. Took {took:.0f} s.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_worker_flags

    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.port, args.rounds, args.out, args.smoke)
        return 0
    from _results import launch_workers, write_section

    began = time.perf_counter()
    flags = ["--rounds", str(args.rounds)] + (["--smoke"] if args.smoke else [])
    times = launch_workers(__file__, flags, NUM_PROCESSES, TIMEOUT_S)
    body = section(times, args.rounds, time.perf_counter() - began)
    print(body)
    if args.smoke:  # toy sizes, which the section does not describe (as gpu.py --cpu-smoke)
        print("--smoke: not writing RESULTS.md")
        return 0
    print(f"wrote {write_section('overlap', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
