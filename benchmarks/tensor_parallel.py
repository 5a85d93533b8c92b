"""What does splitting each stage over a tensor axis save per device, and what does it cost?

The reference GPT pipelined (zb-h1, 2 pp devices, m = 4) over the 8 fake CPU devices, the
other factor of 4 spent on data parallelism (pp 2 x dp 4), on both (pp 2 x dp 2 x tp 2) or on
tensor parallelism (pp 2 x tp 4, ``zbjax.pipeline(param_specs=gpt.tensor_parallel_specs(...))``,
Megatron-style). Per device, from the compiled step's ``memory_analysis()``: the staged param
bytes and the temp bytes (arenas, activations); from its HLO, the collectives; the
compile time, the step time (median over alternating rounds, ratio to pp x dp in the same
round) and the largest gradient difference from ``jax.value_and_grad`` of the unpipelined
loss. Writes the section "tensor_parallel" of ``benchmarks/RESULTS.md``.

Fake CPU devices share the machine's cores, so the step times say what XLA:CPU does with the
collectives, not what a GPU mesh would gain; the memory columns carry over.

Run: ``python benchmarks/tensor_parallel.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, write_section

from models import gpt, gpt_scan
from zbjax.cpu import use_cpu_devices

COMMAND = "python benchmarks/tensor_parallel.py"
CFG = gpt.GPTConfig(vocab_size=256, seq_len=32, d_model=128, num_heads=4, num_layers=4)
BATCH = 16
MESHES = ((2, 4, 1), (2, 2, 2), (2, 1, 4))  # (pp, dp, tp)
#: The GPT with a Python loop over its blocks (cut by markers) and with them in one ``nn.scan``
#: (cut by the auto partitioner, each stage holding its rows of the stacked params).
MODELS = ("loop", "scan")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Row:
    model: str
    mesh: str
    param_bytes: int
    temp_bytes: int
    collectives: dict
    compile_s: float
    step_ms: float
    ratio: float
    grad_diff: float


def _name(shape: tuple[int, int, int]) -> str:
    pp, dp, tp = shape
    return f"pp {pp} x dp {dp}" + (f" x tp {tp}" if tp > 1 else "")


def _build(shape: tuple[int, int, int], cfg: gpt.GPTConfig, batch_size: int, model: str):
    import zbjax

    pp, dp, tp = shape
    if model == "loop":
        module, kwargs = gpt, {}
        cfg = dataclasses.replace(cfg, stage_boundaries=gpt.balanced_boundaries(cfg, pp))
    else:
        module, kwargs = gpt_scan, {"num_stages": pp}
    loss_fn = module.make_loss_fn(cfg)
    params = module.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, batch_size)
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh(shape, ("pp", "dp", "tp"), axis_types=auto)
    specs = gpt.tensor_parallel_specs(params) if tp > 1 else None
    pipe = zbjax.pipeline(
        loss_fn, mesh=mesh, schedule="zb-h1", num_microbatches=4, param_specs=specs, **kwargs
    )
    staged = pipe.stage(params, batch)
    step = jax.jit(pipe.value_and_grad)
    start = time.perf_counter()
    compiled = step.lower(staged, batch).compile()
    compile_s = time.perf_counter() - start
    _, grads = compiled(staged, batch)
    _, want = jax.value_and_grad(loss_fn)(params, batch)
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(pipe.unstage(grads)), jax.tree.leaves(want), strict=True)
    )
    hlo = compiled.as_text()
    counts = {c: len(re.findall(rf"= [^=]*\b{c}\(", hlo)) for c in COLLECTIVES}
    memory = compiled.memory_analysis()
    run = (compiled, staged, batch)
    info = (pipe.lowering.layout.bytes_per_device(), memory.temp_size_in_bytes, counts)
    return run, info, compile_s, diff


def measure(
    rounds: int,
    cfg: gpt.GPTConfig = CFG,
    batch_size: int = BATCH,
    meshes: Sequence[tuple[int, int, int]] = MESHES,
    models: Sequence[str] = MODELS,
) -> list[Row]:
    order = [(model, shape) for model in models for shape in meshes]
    built = {key: _build(key[1], cfg, batch_size, key[0]) for key in order}
    times: dict = {key: [] for key in order}
    for r in range(rounds):
        for key in order[r % len(order) :] + order[: r % len(order)]:
            fn, staged, batch = built[key][0]
            start = time.perf_counter()
            jax.block_until_ready(fn(staged, batch))
            times[key].append(time.perf_counter() - start)
    rows = []
    for model, shape in order:
        _, (param_bytes, temp_bytes, counts), compile_s, diff = built[model, shape]
        t, base = times[model, shape], times[model, meshes[0]]
        rows.append(
            Row(
                model,
                _name(shape),
                param_bytes,
                temp_bytes,
                counts,
                compile_s,
                1e3 * statistics.median(t),
                statistics.median(a / b for a, b in zip(t, base, strict=True)),
                diff,
            )
        )
    return rows


def section(rows: Sequence[Row], rounds: int, load: tuple[str, str], seconds: float) -> str:
    c = CFG
    lines = [
        "## Tensor parallelism inside stages: pp x dp against pp x tp on 8 devices",
        "",
        f"Made by `{COMMAND} --rounds {rounds}` (jax {jax.__version__}, 8 fake CPU devices, "
        f"{os.cpu_count()} cores). The reference GPT ({c.num_layers} blocks, d {c.d_model}, "
        f"{c.num_heads} heads, vocab {c.vocab_size}, seq {c.seq_len}, batch {BATCH}), zb-h1 "
        "over 2 pp devices, m = 4, its blocks in a Python loop (*loop*, cut by "
        "`stage_boundaries`) or in one `nn.scan` (*scan*, `models.gpt_scan`, cut by the auto "
        "partitioner); tp splits it as `gpt.tensor_parallel_specs` says "
        "(Megatron-style: each block's qkv and MLP input projections column-parallel, qkv "
        "by whole heads, its attention output and MLP output projections row-parallel; the "
        "tied token embedding over the vocabulary; LayerNorms and biases after a row-parallel "
        "projection replicated). "
        "*params* and *temp* are per device "
        "(`memory_analysis()`); *collectives* counts each kind's ops in the compiled HLO; "
        f"*step* is the median over {rounds} alternating rounds, *ratio* the median over "
        "rounds of it over the same model's pp x dp in the same round; *grad diff* the "
        "largest difference from `jax.value_and_grad` of the unpipelined loss.",
        "",
        "| model | mesh | params / device | temp / device | collectives | compile | step "
        "| ratio | grad diff |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in r.collectives.items() if n) or "-"
        lines.append(
            f"| {r.model} | {r.mesh} | {r.param_bytes / 1024:.0f} KiB "
            f"| {r.temp_bytes / 1024:.0f} KiB | {kinds} | {r.compile_s:.1f} s "
            f"| {r.step_ms:.1f} ms | {r.ratio:.2f} | {r.grad_diff:.1e} |"
        )
    lines += [
        "",
        f"Load before / after: {load[0]} / {load[1]}; {seconds:.0f} s in all.",
        "",
        "Each device holds its part of each split param and of each activation a stage "
        "computes split (the arenas keep parts, `tensor.value_splits`); activations "
        "computed whole (LayerNorm, the residual stream) are held whole on each tp "
        "device, over more rows per device as dp shrinks. "
        "The collectives run on fake CPU devices sharing the cores, which is what the step "
        "ratios measure.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    start, before = time.perf_counter(), machine_load()
    rows = measure(args.rounds)
    text = section(rows, args.rounds, (before, machine_load()), time.perf_counter() - start)
    print(text)
    write_section("tensor_parallel", text)


if __name__ == "__main__":
    use_cpu_devices(8)
    main()
