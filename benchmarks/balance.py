"""How many FLOPs is a byte worth on this CPU, and what does the cost model's weight do to a cut?

The automatic cut balances matmul FLOPs plus ``bytes_weight`` times the bytes other operations
move (``zbjax.cost_model``): 100 on accelerators (a third of their machine balance), 3 on CPUs.
This measures the balance of XLA:CPU here, one device: matmul FLOP/s against elementwise
bytes/s. Then it cuts three scan MLPs into 4 stages with each weight (100, 10 and the CPU one),
pipelines them on 4 fake devices (1f1b, 4 microbatches) and times every stage's F + B + W with
``pipe.measure_costs``: max/mean over the stages is 1 for a balanced cut. The models: plain;
with a weight decay term in the loss (``1e-4 * sum(stack ** 2)``: bytes of parameters, no
FLOPs); and with the parameters cast to bfloat16 at the top of the loss (the cast of the
stack, also bytes only).

Then the bytes a cut sends: the 4 devices shift messages of several sizes around a ring
inside a ``shard_map`` (as the lowering's exchanges do), which gives the FLOPs a byte sent is
worth (``cost_model.CPU_COMM_WEIGHT``); and the reference GPT with a 4096-token vocabulary
is cut into 4 stages by the cost model without that weight, with it, and by markers between
its blocks, each pipelined and its jitted step timed in alternating rounds. Writes the section
"balance" of ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/balance.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, write_section

from models import gpt

COMMAND = "python benchmarks/balance.py"
DEVICES = 4
MICROBATCHES = 4
#: Matmuls [2 width, width] x [width, width] and elementwise sizes timed for the balance: large
#: enough that a call's dispatch (some microseconds) is a small part of its time.
MATMUL_WIDTHS = (128, 256, 512, 1024)
ELEMENTWISE_SIZES = (2**18, 2**20, 2**22, 2**24)
#: The scan MLP: its width, layers and batch (microbatches of batch / MICROBATCHES rows).
MLP = dict(width=64, layers=8, batch=256)
SMOKE_MLP = dict(width=8, layers=4, batch=16)
#: Message bytes shifted around the ring, and the ticks of one timed program.
MESSAGE_SIZES = (2**12, 2**14, 2**16, 2**18, 2**20, 2**22)
RING_TICKS = 16
#: The GPT whose logits outweigh its residual stream 128 times.
VOCAB_GPT = dict(vocab_size=4096, num_layers=6, d_model=32, seq_len=16, batch=16)
SMOKE_VOCAB_GPT = dict(vocab_size=4096, num_layers=4, d_model=16, seq_len=8, batch=8)


def median_time(fn: Callable, *args, repeats: int) -> float:
    """Returns the median seconds of ``repeats`` calls of the jitted ``fn`` after one warm-up."""
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_balance(repeats: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Returns ([(width, matmul GFLOP/s)], [(elements, elementwise GB/s)]) on one device."""
    device = jax.devices()[0]
    flops = []
    for width in MATMUL_WIDTHS:
        x = jax.device_put(jnp.ones((2 * width, width)), device)
        w = jax.device_put(jnp.ones((width, width)), device)
        seconds = median_time(lambda x, w: x @ w, x, w, repeats=repeats)
        flops.append((width, 2 * 2 * width * width * width / seconds / 1e9))
    moved = []
    for n in ELEMENTWISE_SIZES:
        x = jax.device_put(jnp.ones((n,)), device)
        # A fused chain reads and writes each float once: 8 bytes an element.
        seconds = median_time(lambda x: jnp.tanh(x) * 2.0 + x, x, repeats=repeats)
        moved.append((n, 8 * n / seconds / 1e9))
    return flops, moved


def mlp_case(kind: str, sizes: dict) -> tuple[Callable, dict, tuple]:
    """Returns (loss_fn, params, batch) of the scan MLP: "plain", "decay" or "bfloat16"."""
    width, layers, batch = sizes["width"], sizes["layers"], sizes["batch"]
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "w_in": jax.random.normal(k[0], (8, width)) * 0.3,
        "stack": jax.random.normal(k[1], (layers, width, width)) / np.sqrt(width),
        "out": jax.random.normal(k[2], (width,)),
    }
    data = (jax.random.normal(k[3], (batch, 8)), jax.random.normal(k[4], (batch,)))

    def loss_fn(p, b):
        if kind == "bfloat16":
            p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        h = b[0].astype(p["w_in"].dtype) @ p["w_in"]
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) + h, None), h, p["stack"])
        loss = jnp.mean((h @ p["out"] - b[1]) ** 2).astype(jnp.float32)
        if kind == "decay":
            loss = loss + 1e-4 * jnp.sum(p["stack"] ** 2)
        return loss

    return loss_fn, params, data


def cut_balance(kind: str, weight: float, sizes: dict, repeats: int) -> dict:
    """Returns the layers per stage, predicted and measured max/mean of a cut with ``weight``."""
    import zbjax
    from zbjax import cost_model

    loss_fn, params, batch = mlp_case(kind, sizes)
    mesh = jax.make_mesh((DEVICES,), ("pp",), devices=jax.devices()[:DEVICES])
    kept = cost_model.CPU_BYTES_WEIGHT
    cost_model.CPU_BYTES_WEIGHT = weight  # what the pipeline's CPU mesh estimates with
    try:
        pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=MICROBATCHES)
        pipe.lower(params, batch)
    finally:
        cost_model.CPU_BYTES_WEIGHT = kept
    measured = pipe.measure_costs(params, batch, repeats=repeats, comm=False)
    per_stage = np.array(measured.f) + np.array(measured.b) + np.array(measured.w)
    predicted = np.array([s.cost for s in pipe.graph.stages])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    stack = paths.index("['stack']")
    layers = []
    for stage in pipe.graph.stages:
        held = dict(zip(stage.param_leaves, stage.param_slices(), strict=True))
        rows = held.get(stack, (0, 0))
        layers.append(sizes["layers"] if rows is None else rows[1] - rows[0])
    return {
        "layers": layers,
        "predicted": float(predicted.max() / predicted.mean()),
        "measured": float(per_stage.max() / per_stage.mean()),
    }


def exchange_rate(repeats: int) -> list[tuple[int, float]]:
    """Returns [(message bytes, seconds per tick)]: every device sends its message to the next
    around a ring, ``RING_TICKS`` times in a ``lax.scan`` inside a ``shard_map``."""
    from jax.sharding import PartitionSpec

    mesh = jax.make_mesh(
        (DEVICES,),
        ("pp",),
        devices=jax.devices()[:DEVICES],
        axis_types=(jax.sharding.AxisType.Auto,),
    )
    ring = [(d, (d + 1) % DEVICES) for d in range(DEVICES)]

    def ticks(message):
        def tick(carry, _):
            return jax.lax.ppermute(carry * 1.5, "pp", ring), None

        return jax.lax.scan(tick, message, None, length=RING_TICKS)[0]

    step = jax.shard_map(
        ticks, mesh=mesh, in_specs=PartitionSpec("pp"), out_specs=PartitionSpec("pp")
    )
    rates = []
    for size in MESSAGE_SIZES:
        messages = jnp.ones((DEVICES * size // 4,), jnp.float32)
        rates.append((size, median_time(step, messages, repeats=repeats) / RING_TICKS))
    return rates


def vocab_cuts(sizes: dict, repeats: int) -> dict[str, dict]:
    """Returns, per cut of the GPT ("no byte weight", "byte weight", "markers"), the largest
    edge's bytes, the stages' predicted shares and the median step seconds, timed in
    alternating rounds."""
    import zbjax
    from zbjax import cost_model

    mesh = jax.make_mesh((DEVICES,), ("pp",), devices=jax.devices()[:DEVICES])
    layers = sizes["num_layers"]
    markers = tuple(layers * k // DEVICES for k in range(1, DEVICES))
    variants = {"no byte weight": (0.0, ()), "byte weight": (cost_model.CPU_COMM_WEIGHT, ())}
    variants["markers"] = (cost_model.CPU_COMM_WEIGHT, markers)
    found, steps = {}, {}
    for name, (weight, bounds) in variants.items():
        cfg = gpt.GPTConfig(
            **{k: v for k, v in sizes.items() if k != "batch"}, stage_boundaries=bounds
        )
        params = gpt.init_params(jax.random.key(0), cfg)
        batch = gpt.make_batch(jax.random.key(1), cfg, batch_size=sizes["batch"])
        kept = cost_model.CPU_COMM_WEIGHT
        cost_model.CPU_COMM_WEIGHT = weight  # what the pipeline's CPU mesh cuts with
        try:
            pipe = zbjax.pipeline(
                gpt.make_loss_fn(cfg), mesh=mesh, schedule="1f1b", num_microbatches=MICROBATCHES
            )
            staged = pipe.stage(params, batch)
        finally:
            cost_model.CPU_COMM_WEIGHT = kept
        step = jax.jit(pipe.value_and_grad)
        jax.block_until_ready(step(staged, batch))
        steps[name] = (step, staged, batch)
        cost = np.array([s.cost for s in pipe.graph.stages])
        found[name] = {
            "edge": max(sum(v.size * v.dtype.itemsize for v in e.values) for e in pipe.graph.edges),
            "shares": [float(c) for c in cost / cost.sum()],
            "times": [],
        }
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, staged, batch = steps[name]
            start = time.perf_counter()
            jax.block_until_ready(step(staged, batch))
            found[name]["times"].append(time.perf_counter() - start)
    for name in names:
        found[name]["step"] = statistics.median(found[name]["times"])
    return found


def comm_lines(ring: list[tuple[int, float]], gflops: float, vocab: dict[str, dict]) -> list[str]:
    """Returns the markdown of the exchange rate and the vocabulary cuts."""
    from zbjax import cost_model

    slope = float(np.polyfit([b for b, _ in ring], [t for _, t in ring], 1)[0])  # s per byte
    rows = ["| message bytes | µs per tick |", "|---|---|"]
    rows += [f"| {b:,} | {t * 1e6:.1f} |" for b, t in ring]
    cut_rows = [
        "| cut | largest edge (bytes) | predicted stage shares | step (ms) | step / markers |",
        "|---|---|---|---|---|",
    ]
    base = vocab["markers"]["step"]
    cut_rows += [
        f"| {name} | {v['edge']:,} | {' / '.join(f'{x:.0%}' for x in v['shares'])} | "
        f"{v['step'] * 1e3:.2f} | {v['step'] / base:.2f} |"
        for name, v in vocab.items()
    ]
    g = VOCAB_GPT
    return [
        f"Bytes sent: {DEVICES} devices shift a message around a ring {RING_TICKS} times in "
        "one jitted `shard_map` (medians per tick):",
        "",
        *rows,
        "",
        f"A least-squares line through them: {1 / slope / 1e9:.1f} GB/s per device, so at the "
        f"matmuls' median {gflops:.0f} GFLOP/s a byte sent is worth {gflops * 1e9 * slope:.0f} "
        "FLOPs in this run; `cost_model.CPU_COMM_WEIGHT`, set from such a run, is "
        f"{cost_model.CPU_COMM_WEIGHT:g} (the cut charges two thirds of it per byte crossing, "
        "an activation and its cotangent against F, B and W).",
        "",
        f"The reference GPT (vocabulary {g['vocab_size']}, {g['num_layers']} layers, d_model "
        f"{g['d_model']}, sequence {g['seq_len']}, batch {g['batch']}) on {DEVICES} fake "
        f"devices, 1f1b, m = {MICROBATCHES}, cut by the cost model without and with the weight "
        f"on bytes crossing (`CPU_COMM_WEIGHT` = {cost_model.CPU_COMM_WEIGHT:g}, beyond "
        f"{cost_model.CPU_COMM_FREE_BYTES:,} bytes a message: the constant, set from an earlier "
        "run of this script), and by markers between its blocks; steps timed in alternating "
        "rounds (medians):",
        "",
        *cut_rows,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after measuring the balance and the cuts and writing the section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed calls per measurement")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", DEVICES)  # before any computation
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    from zbjax import cost_model

    began, load_before = time.perf_counter(), machine_load()
    flops, moved = machine_balance(args.repeats)
    weights = (cost_model.BYTES_WEIGHT, 10.0, cost_model.CPU_BYTES_WEIGHT)
    cuts = {
        (kind, w): cut_balance(kind, w, MLP, args.repeats)
        for kind in ("plain", "decay", "bfloat16")
        for w in weights
    }
    ring = exchange_rate(args.repeats)
    vocab = vocab_cuts(VOCAB_GPT, args.repeats)
    rows = ["| matmul width | GFLOP/s | elementwise elements | GB/s |", "|---|---|---|---|"]
    rows += [
        f"| {w} | {f:.1f} | {n:,} | {b:.2f} |" for (w, f), (n, b) in zip(flops, moved, strict=True)
    ]
    balance = statistics.median(f for _, f in flops) / statistics.median(b for _, b in moved)
    cut_rows = [
        "| model | bytes weight | stack rows per stage | predicted max/mean | measured max/mean |",
        "|---|---|---|---|---|",
    ]
    cut_rows += [
        f"| {kind} | {w:g} | {c['layers']} | {c['predicted']:.2f} | {c['measured']:.2f} |"
        for (kind, w), c in cuts.items()
    ]
    body = "\n".join(
        [
            "## The cost model's byte weights on CPU",
            "",
            f"Made by `{COMMAND} --repeats {args.repeats}` (jax {jax.__version__}, "
            f"{os.cpu_count()} CPU cores). Machine balance of XLA:CPU on one device (medians "
            f"of {args.repeats} calls): matmuls [2w, w] x [w, w] against a fused elementwise "
            "chain reading and writing 8 bytes an element.",
            "",
            *rows,
            "",
            f"Median over the sizes: {balance:.1f} FLOPs for a byte (the cost model charges "
            "about a third of a platform's balance, as fused elementwise chains move less than "
            "every op's operands).",
            "",
            f"Scan MLPs (width {MLP['width']}, {MLP['layers']} layers, batch {MLP['batch']}) "
            f"cut into {DEVICES} stages by the cost model with each bytes weight, 1f1b on "
            f"{DEVICES} fake devices, m = {MICROBATCHES}; *measured* is max/mean over stages "
            "of each stage's F + B + W timed by `pipe.measure_costs` (medians of "
            f"{args.repeats}); *stack rows per stage*: the rows (layers) of the stacked "
            "weights each stage holds (the stage computing the weight decay holds them all).",
            "",
            *cut_rows,
            "",
            *comm_lines(ring, statistics.median(f for _, f in flops), vocab),
            "",
            f"Machine load before: `{load_before}`; after: `{machine_load()}`. "
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("balance", body)
    print(body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
