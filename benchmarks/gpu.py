"""The B/W split and memory benchmarks at realistic sizes (GPT width 4096) on a GPU.

Five parts, in this order (the last needs 2 or more GPUs), written to finish in under 5
minutes on one H100/H200-class GPU:

1. **Per-tick overhead** of the lowered tick loop (a ``lax.cond`` per action inside a
   ``lax.scan`` may cost a host round trip per tick on a GPU): gpipe steps of a width-8 MLP,
   one layer per device, at m in {4, 16, 64}, step time regressed on the number of ticks.
2. **B/W split overhead** (``bw_split.py``) at width 4096: B-then-W against fused BW for each
   reference stage, alternating, median ratio, matmul FLOPs. Each timed sample queues
   ``--chain`` calls before it waits, so the host's dispatch overlaps the GPU's work as in a
   pipeline step; then each program's GPU kernel time from a ``jax.profiler`` trace, GEMM
   kernels apart from the rest (``--dump DIR`` also writes each program's HLO and trace);
   and the time of copying the stash values B writes for W once, the cost of B's copy of
   them into a slot and of W's out of one (``bw_split.copy_seconds``). The GPT's middle stage
   runs a second time computing in bfloat16 on float32 params, as mixed-precision training
   runs it.
3. **B/W split in the step** (``bw_in_step.py``) at width 4096, on one GPU: the MLP and the
   GPT cut into 3 stages and pipelined on one device by ``dag-zb`` (every backward split)
   against the same schedule with every backward fused, alternating rounds: what the split
   adds to the backward inside the compiled step, and each stage's B + W over BW from traces
   (those need the command buffers off, as in part 5).
4. **Memory** (``memory.py``) at width 4096: with 4 or more GPUs, the compiled per-device memory
   of every schedule's pipeline step; with fewer, the compiled memory of one stage's F, B, W
   and BW programs (what M_B and M_W are at this size) and every schedule's predicted peak.
5. **Step time** (``step_time.py``'s question, with 2 or more GPUs): ``step_time``'s MLP at
   width 4096 on the first 2 GPUs, every schedule planned by the stage costs measured alone
   (``pipe.measure_costs``), alternating rounds, measured ratio to 1f1b next to the
   simulator's and the lockstep model's; then 1f1b and zb-h2 profiled in the step
   (``pipe.profile``), and the same predictions from the actions' in-step times
   (``ActionTimes.costs``). XLA's command buffers hide the actions from a GPU trace (their
   kernels carry the buffer's name); with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` they
   show, and the section says how many actions the profiles timed.

Writes the section "gpu" of ``benchmarks/RESULTS.md``. Without a GPU it refuses (exit 2);
``--cpu-smoke`` runs every part at toy sizes on CPU and prints, writing nothing.

Run: ``python benchmarks/gpu.py`` on a GPU machine (``--cpu-smoke`` to check it on CPU;
``--parts in-step,memory`` runs only the parts named, of ``tick``, ``split``, ``in-step``,
``memory`` and ``step-time``, always in that order, and writes them to a section of their
own, here "gpu-in-step-memory").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bw_in_step
import bw_split
import memory
import step_time
from _results import write_section

import zbjax
from models import gpt, mlp
from zbjax import schedules
from zbjax.partition import partition
from zbjax.profile import LOOP_RUNS
from zbjax.split import split

COMMAND = "python benchmarks/gpu.py"
REALISTIC = bw_split.Sizes(
    gpt_width=4096,
    gpt_heads=32,
    gpt_seq=1024,
    gpt_vocab=32000,
    gpt_batch=2,
    blocks_per_stage=1,
    mlp_width=4096,
    mlp_layers_per_stage=4,
    mlp_batch=4096,
)
REALISTIC_MEMORY = memory.Model(
    d_model=4096, num_heads=32, seq_len=1024, vocab_size=32000, num_layers=8, microbatch_rows=1
)
MEMORY_MICROBATCHES = 8
#: The B/W split in the step: the first models of ``bw_in_step.reference_models`` (the MLP
#: and the GPT; the scanned GPT's stages are the GPT's).
IN_STEP_MODELS = 2
#: ... and about this long per model for its alternating rounds (``bw_in_step.measure``).
IN_STEP_SECONDS = 20.0
#: The step-time part: ``step_time``'s MLP at width 4096 (4 layers per GPU, 4096 rows per
#: microbatch), these schedules, m microbatches, on 2 GPUs.
STEP_SETUP = step_time.Setup(width=4096, layers_per_stage=4, microbatch_rows=4096)
STEP_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto")
STEP_MICROBATCHES = 8
# Calls of each looped program inside one profiler trace (each call runs it LOOP_RUNS times).
TRACED_CALLS = 3
# Kernels from a matrix library (cuBLAS, cuBLASLt, CUTLASS) or XLA's own Triton GEMMs.
GEMM_KERNEL = re.compile(r"gemm|xmma|cutlass|cublas|wgmma|matmul", re.IGNORECASE)


def in_step_split_section(
    sizes: bw_split.Sizes, rounds: int, profiles: int, seconds: float = IN_STEP_SECONDS
) -> str:
    """Returns the B/W split in the compiled step on one device (``bw_in_step``) for the MLP
    and the GPT at ``sizes`` (at least ``rounds`` rounds, more while ``seconds`` last)."""
    results = [
        bw_in_step.measure(model, rounds, profiles, seconds=seconds)
        for model in bw_in_step.reference_models(sizes)[:IN_STEP_MODELS]
    ]
    return "\n".join(
        [
            f"**B/W split in the step** (one device, m = {bw_in_step.MICROBATCHES}: `dag-zb` "
            "over the 3 stages, every backward split, against the same schedule with every "
            f"backward fused; at least {rounds} alternating rounds, more while {seconds:g} s "
            f"last; {profiles} profile(s) of each; see "
            "the bw_in_step section; traced columns need "
            "`XLA_FLAGS=--xla_gpu_enable_command_buffer=`):",
            "",
            bw_in_step.table(results),
            "",
            bw_in_step.target_line(results),
        ]
    )


def tick_overhead_section(rounds: int) -> str:
    """Returns the markdown lines for the per-tick overhead on the available devices."""
    devices = jax.devices()
    p = min(len(devices), 2)
    mesh = jax.sharding.Mesh(np.array(devices[:p]), (step_time.AXIS,))
    overhead = step_time.tick_overhead(mesh, rounds)
    points = ", ".join(f"{t} ticks: {s * 1e3:.3f} ms" for t, s in overhead.points)
    return (
        f"**Per-tick overhead** ({p} device{'s' if p > 1 else ''}, gpipe, width-8 MLP): "
        f"{overhead.per_tick * 1e6:.1f} µs per tick, {overhead.fixed * 1e3:.2f} ms fixed per "
        f"step ({points})."
    )


def bw_split_section(sizes: bw_split.Sizes, repeats: int, chain: int, dump: Path | None) -> str:
    """Returns the B/W split tables at ``sizes``: wall time of B then W against BW (``chain``
    calls queued per sample, ``bw_split.measure_prepared``), and the GPU kernel time of each
    program from a profiler trace (``dump``: also write each program's HLO and trace there).
    BW is also timed as JAX traced it (the table's last columns), which says whether merging
    contracting dimensions and unrolling short scans pay on the GPU too; and copying B's new
    stash once (``bw_split.copy_seconds``), which says how much of the split's cost its two
    copies (into a slot, out of one) explain."""
    measurements, kernel_rows, kernel_ratios = [], [], []
    # The GPT's middle stage also as mixed-precision training runs it: bfloat16 layers on
    # float32 params.
    half = bw_split.gpt_linen_cases(dataclasses.replace(sizes, gpt_dtype="bfloat16"))[1]
    for case in [*bw_split.reference_cases(sizes), half]:
        p = bw_split.prepare(case, unmerged=True)
        m = bw_split.measure_prepared(case.label, p, repeats, chain, copies=True)
        measurements.append(m)
        short = re.sub(r"\W+", "_", case.label.split(" (")[0]).strip("_")
        kernels = {
            name: program_kernels(fn, args, dump / f"{short}_{name}" if dump else None)
            for name, fn, args in (
                ("B", p.backward_input, tuple(p.args)),
                ("W", p.backward_weight, (p.residuals, p.new)),
                ("BW", p.backward, tuple(p.args)),
            )
        }
        fused = kernels["BW"][0]
        ratio = (kernels["B"][0] + kernels["W"][0]) / fused if fused else float("nan")
        kernel_ratios.append(ratio)
        for name, (total, gemm, top) in kernels.items():
            kernel_rows.append(
                f"| {case.label} | {name} | {total:.2f} | {gemm:.2f} | {total - gemm:.2f} | {top} |"
            )
        print(f"{m.label}: wall ratio {m.ratio:.3f}, kernel-time ratio {ratio:.3f}", flush=True)
    return "\n".join(
        [
            f"**B/W split** ({repeats} alternating pairs per stage, each sample {chain} calls "
            f"of {LOOP_RUNS} runs queued before one wait; ratio = median of (B then W) / BW; "
            "*1 + 2 copies / BW*: the ratio if copying the stash values B writes for W into a "
            "slot (B) and out of one (W) were the split's only extra work, from one copy's "
            "time, `bw_split.copy_seconds`, waiting after each call):",
            "",
            bw_split.table(measurements),
            "",
            f"**GPU kernel time per run** (a `jax.profiler` trace of {TRACED_CALLS} calls of "
            f"{LOOP_RUNS} runs of each program alone; GEMM = cuBLAS/CUTLASS/Triton matrix "
            "kernels; other = the largest non-GEMM HLO ops):",
            "",
            "| stage | program | kernels (ms) | GEMM (ms) | other (ms) | largest other (ms) |",
            "|---|---|---|---|---|---|",
            *kernel_rows,
            "",
            "Kernel-time ratio (B + W) / BW per stage: "
            + ", ".join(f"{r:.3f}" for r in kernel_ratios)
            + ".",
            "",
            f"Worst ratio: wall {max(m.ratio for m in measurements):.3f}, kernel time "
            f"{max(kernel_ratios):.3f} (target ≤ {bw_split.TARGET_RATIO}).",
        ]
    )


def device_kernels(trace_dir: Path) -> list[tuple[str, str, float]]:
    """Returns (kernel name, HLO op, microseconds) of every GPU kernel in the perfetto trace
    ``jax.profiler`` wrote under ``trace_dir`` (empty when the trace holds no GPU kernels)."""
    (path,) = trace_dir.rglob("perfetto_trace.json.gz")
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    gpus = {e["pid"] for e in meta if e["name"] == "process_name" and "GPU" in e["args"]["name"]}
    # Kernels sit on the lines of the CUDA streams; other device lines summarise them.
    streams = {
        (e["pid"], e["tid"])
        for e in meta
        if e["name"] == "thread_name" and e["pid"] in gpus and "Stream" in e["args"]["name"]
    }
    return [
        (e["name"], e.get("args", {}).get("hlo_op", ""), float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams
    ]


def program_kernels(fn: Any, args: tuple, dump: Path | None) -> tuple[float, float, str]:
    """Returns (kernel ms, GEMM kernel ms, the largest other HLO ops) per run of the looped
    program ``fn`` on ``args``, from a ``jax.profiler`` trace of ``TRACED_CALLS`` calls.
    ``dump``: also write its trace and optimised HLO to files starting with that path."""
    jax.block_until_ready(fn(*args))  # compiled and warm
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(TRACED_CALLS):
                jax.block_until_ready(fn(*args))
        kernels = device_kernels(Path(tmp))
        if dump is not None:
            (trace,) = Path(tmp).rglob("perfetto_trace.json.gz")
            shutil.copy(trace, f"{dump}.perfetto.json.gz")
    if dump is not None:
        Path(f"{dump}.hlo.txt").write_text(fn.lower(*args).compile().as_text())
    runs = TRACED_CALLS * LOOP_RUNS
    gemm = sum(d for k, _, d in kernels if GEMM_KERNEL.search(k)) / runs / 1e3
    total = sum(d for _, _, d in kernels) / runs / 1e3
    other: collections.Counter = collections.Counter()
    for k, op, d in kernels:
        if not GEMM_KERNEL.search(k):
            other[op or k] += d / runs / 1e3
    return total, gemm, ", ".join(f"{op} {ms:.2f}" for op, ms in other.most_common(3)) or "–"


def _compiled_memory(closed, args) -> tuple[int, int]:
    """Returns (temp bytes, output bytes) of ``closed`` jitted and compiled for ``args``."""
    analysis = jax.jit(jaxpr_as_fun(closed)).lower(*args).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)


def stage_memory_section(model: memory.Model) -> str:
    """Returns the per-program compiled memory of a middle GPT stage and each schedule's
    predicted peak in bytes (for one device, when too few devices for a pipeline)."""
    cfg = memory.gpt_config(model, memory.NUM_DEVICES)
    params = jax.eval_shape(lambda k: gpt.init_params(k, cfg), jax.random.key(0))
    microbatch = jax.eval_shape(
        lambda k: gpt.make_batch(k, cfg, model.microbatch_rows), jax.random.key(1)
    )
    graph = partition(gpt.make_loss_fn(cfg), params, microbatch)
    programs = split(graph)
    index = 1
    program = programs[index]
    fwd_args = list(program.forward.in_avals)
    bwd_args = list(program.backward_input.in_avals)
    stash_args = list(program.backward_weight.in_avals)
    lines = [
        f"**Memory** (1 device: compiled memory of stage {index} of {memory.NUM_DEVICES}, "
        f"GPT d_model {model.d_model}, seq {model.seq_len}, {model.microbatch_rows} sequence "
        "per microbatch, in MB):",
        "",
        "| program | temp | outputs |",
        "|---|---|---|",
    ]
    for label, closed, args in (
        ("F", program.forward, fwd_args),
        ("B", program.backward_input, bwd_args),
        ("W", program.backward_weight, stash_args),
        ("BW", program.backward, bwd_args),
    ):
        temp, out = _compiled_memory(closed, args)
        lines.append(f"| {label} | {temp / 1e6:.1f} | {out / 1e6:.1f} |")
    lines += [
        "",
        f"M_B (activation_bytes) {program.activation_bytes / 1e6:.1f} MB, M_W (stash_bytes) "
        f"{program.stash_bytes / 1e6:.1f} MB, params {program.param_bytes / 1e6:.1f} MB.",
        "",
        f"Predicted peak activations per device, {memory.NUM_DEVICES} devices, "
        f"m = {MEMORY_MICROBATCHES}:",
        "",
        "| schedule | peak (M_B) | bytes (MB) |",
        "|---|---|---|",
    ]
    for name in memory.SCHEDULE_NAMES:
        stages = 2 * memory.NUM_DEVICES if name in memory.TWO_STAGES_PER_DEVICE else None
        stages = stages or memory.NUM_DEVICES
        sched_programs = programs
        if stages != memory.NUM_DEVICES:
            cfg_n = memory.gpt_config(model, stages)
            sched_programs = split(partition(gpt.make_loss_fn(cfg_n), params, microbatch))
        schedule = schedules.build(
            name,
            stages,
            MEMORY_MICROBATCHES,
            num_devices=memory.NUM_DEVICES,
            costs=memory.program_costs(sched_programs),
        )
        units, peak = memory.predicted_peak(schedule, sched_programs)
        lines.append(f"| {name} | {units:.3g} | {peak / 1e6:.1f} |")
    return "\n".join(lines)


def pipeline_memory_section(model: memory.Model) -> str:
    """Returns the compiled per-device memory of every schedule (needs 4 devices)."""
    devices = jax.devices()[: memory.NUM_DEVICES]
    mesh = jax.sharding.Mesh(np.array(devices), (memory.AXIS,))
    rows = []
    for name in memory.SCHEDULE_NAMES:
        rows.append(memory.measure(name, MEMORY_MICROBATCHES, model, mesh))
        print(memory.table(rows[-1:]).splitlines()[-1], flush=True)
    return "\n".join(
        [
            f"**Memory** ({memory.NUM_DEVICES} devices, m = {MEMORY_MICROBATCHES}, GPT d_model "
            f"{model.d_model}; kB per device, columns as in the memory section):",
            "",
            memory.table(rows),
        ]
    )


def step_time_section(setup: step_time.Setup, m: int, rounds: int, profile_steps: int) -> str:
    """Returns the step time of ``STEP_SCHEDULES`` on the first 2 devices, measured against
    predicted from the costs alone and from the actions' times in the step (needs 2)."""
    mesh = step_time.make_mesh()
    cfg = step_time.mlp_config(setup, step_time.NUM_DEVICES)
    params = mlp.init_params(jax.random.key(0), cfg)
    loss_fn = mlp.make_loss_fn(cfg)
    batch = mlp.make_batch(jax.random.key(1), cfg, m * setup.microbatch_rows)

    def schedule_of(name: str, costs: schedules.Costs | None) -> schedules.Schedule:
        return schedules.build(name, step_time.NUM_DEVICES, m, costs=costs)

    def pipe_of(schedule: schedules.Schedule, costs: schedules.Costs | None) -> Any:
        return zbjax.pipeline(
            loss_fn,
            mesh=mesh,
            axis_name=step_time.AXIS,
            schedule=schedule,
            num_microbatches=m,
            costs=costs,
        )

    probe = pipe_of(schedule_of("1f1b", None), None)
    alone = probe.measure_costs(params, batch, repeats=max(rounds // 2, 2))
    built = {name: schedule_of(name, alone) for name in STEP_SCHEDULES}
    pipes = {name: pipe_of(schedule, alone) for name, schedule in built.items()}
    staged = {name: pipe.stage(params, batch) for name, pipe in pipes.items()}
    steps = {
        name: (lambda pipe=pipe, p=staged[name]: pipe.value_and_grad(p, batch))
        for name, pipe in pipes.items()
    }
    times = step_time.alternate(steps, rounds)
    # The actions' times in the step: F and BW as 1f1b ran them, B and W as zb-h2 did with
    # every stage kept split (its planner given no fused backward's time).
    split_costs = step_time.split_costs(alone)
    split = pipe_of(schedule_of("zb-h2", split_costs), split_costs)
    profiles = {
        "zb-h2": split.profile(split.stage(params, batch), batch, steps=profile_steps),
        "1f1b": pipes["1f1b"].profile(staged["1f1b"], batch, steps=profile_steps),
    }
    in_step = profiles["1f1b"].costs(profiles["zb-h2"].costs(alone))
    timed = {
        name: sum(scope in scopes for scopes in t.seconds.values() for scope in t.runs)
        for name, t in profiles.items()
    }
    predicted = {
        (name, which): step_time.predict(built[name], costs, plan_costs=alone)
        for name in STEP_SCHEDULES
        for which, costs in (("alone", alone), ("in-step", in_step))
    }

    def ratio(name: str, which: str, lockstep: bool) -> float:
        def of(n: str) -> float:
            p = predicted[n, which]
            return p.lockstep + p.comm if lockstep else p.makespan

        return of(name) / of("1f1b")

    def costs_text(costs: schedules.Costs) -> str:
        f, b, w = costs.per_stage(step_time.NUM_DEVICES)
        bw = costs.fused_per_stage(step_time.NUM_DEVICES)
        return "; ".join(
            f"stage {s}: F {1e3 * f[s]:.2f} / B {1e3 * b[s]:.2f} / W {1e3 * w[s]:.2f} / "
            f"BW {1e3 * bw[s]:.2f} ms"
            for s in range(len(f))
        )

    rows = [
        f"| {name} | {1e3 * statistics.median(times[name]):.2f} | "
        f"{step_time.median_ratio(times, name, '1f1b'):.3f} | "
        f"{ratio(name, 'alone', False):.3f} | {ratio(name, 'alone', True):.3f} | "
        f"{ratio(name, 'in-step', False):.3f} | {ratio(name, 'in-step', True):.3f} | "
        f"{step_time.stages_text(predicted[name, 'alone'].fused)} |"
        for name in STEP_SCHEDULES
    ]
    return "\n".join(
        [
            f"**Step time** (2 devices, `step_time`'s MLP: {2 * setup.layers_per_stage} x "
            f"Dense({setup.width}), {setup.microbatch_rows} rows per microbatch, m = {m}; "
            f"{rounds} alternating rounds, medians; predictions as in `step_time`, the "
            "pipelines planned by the costs alone). Costs alone (`pipe.measure_costs`, "
            f"`comm` {1e3 * alone.comm:.3f} ms): {costs_text(alone)}. In the step "
            f"(`pipe.profile` of 1f1b and of zb-h2 with every stage kept split, steps traced: "
            f"{profile_steps}; actions timed: 1f1b {timed['1f1b']} of "
            f"{len(profiles['1f1b'].runs)}, zb-h2 {timed['zb-h2']} of "
            f"{len(profiles['zb-h2'].runs)}; the rest keep their time alone): "
            f"{costs_text(in_step)}.",
            "",
            "| schedule | step (ms) | measured / 1f1b | predicted / 1f1b | lockstep + comm / "
            "1f1b | predicted / 1f1b (in-step) | lockstep + comm / 1f1b (in-step) | stages "
            "run fused (BW) |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


#: The parts, by the names ``--parts`` takes, in the order they run.
PARTS = ("tick", "split", "in-step", "memory", "step-time")


def chosen_parts(text: str) -> tuple[str, ...]:
    """Returns the parts ``--parts`` names (comma-separated), in running order; raises
    ValueError naming the parts there are for an unknown one."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PARTS]
    if unknown or not names:
        raise ValueError(
            f"--parts {text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'none named'}; "
            f"name some of {', '.join(PARTS)}, comma-separated"
        )
    return tuple(part for part in PARTS if part in names)


def section_name(parts: Sequence[str]) -> str:
    """Returns the RESULTS.md section a run of ``parts`` writes: "gpu" for every part, else a
    section of its own, so a partial run leaves the full one in place."""
    return "gpu" if tuple(parts) == PARTS else "gpu-" + "-".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after running the chosen parts (2 when there is no GPU and no --cpu-smoke,
    or for unknown parts)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU, no writes")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"which parts to run, comma-separated, of {', '.join(PARTS)} (default: all); a "
        "partial run writes a section of its own",
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--chain", type=int, default=4, help="B/W split: calls queued per timed sample"
    )
    parser.add_argument(
        "--dump", type=Path, default=None, help="write each traced program's HLO and trace here"
    )
    args = parser.parse_args(argv)
    try:
        run = chosen_parts(args.parts)
    except ValueError as err:
        parser.error(str(err))
    if args.cpu_smoke:
        jax.config.update("jax_num_cpu_devices", memory.NUM_DEVICES)
    backend = jax.default_backend()
    if backend != "gpu" and not args.cpu_smoke:
        print(
            f"gpu.py measures GPU behaviour, but JAX's backend here is {backend!r} "
            f"({jax.devices()[0].device_kind}); run it on a GPU machine, or pass --cpu-smoke "
            "to check the script at toy sizes on CPU (nothing is written).",
            file=sys.stderr,
        )
        return 2
    began = time.perf_counter()
    smoke = args.cpu_smoke
    repeats = 3 if smoke else args.repeats
    parts = []
    if "tick" in run:
        parts.append(tick_overhead_section(rounds=3 if smoke else 11))
        print(parts[-1], flush=True)
    if args.dump is not None:
        args.dump.mkdir(parents=True, exist_ok=True)
    sizes = bw_split.SMOKE_SIZES if smoke else REALISTIC
    if "split" in run:
        parts.append(bw_split_section(sizes, repeats, 2 if smoke else args.chain, args.dump))
        print(parts[-1], flush=True)
    if "in-step" in run:
        seconds = 0.0 if smoke else IN_STEP_SECONDS
        parts.append(in_step_split_section(sizes, 3 if smoke else 11, 1, seconds))
        print(parts[-1], flush=True)
    if "memory" in run:
        model = memory.SMOKE_MODEL if smoke else REALISTIC_MEMORY
        if len(jax.devices()) >= memory.NUM_DEVICES and not smoke:
            parts.append(pipeline_memory_section(model))
        else:
            parts.append(stage_memory_section(model))
        print(parts[-1], flush=True)
    if "step-time" in run:
        if len(jax.devices()) >= step_time.NUM_DEVICES:
            setup = step_time.SMOKE_SETUP if smoke else STEP_SETUP
            parts.append(
                step_time_section(
                    setup, 4 if smoke else STEP_MICROBATCHES, 3 if smoke else 11, 1 if smoke else 3
                )
            )
        else:
            parts.append(
                f"**Step time**: not run; it needs {step_time.NUM_DEVICES} or more devices, "
                f"and only {len(jax.devices())} is here."
            )
        print(parts[-1], flush=True)
    device = jax.devices()[0]
    body = "\n\n".join(
        [
            "## GPU: per-tick overhead, B/W split (alone and in the step), memory and step time at "
            "width 4096",
            f"Made by `{COMMAND}{'' if run == PARTS else ' --parts ' + ','.join(run)}` on "
            f"{len(jax.devices())} x {device.device_kind} "
            f"(jax {jax.__version__}). Timings are medians; see the bw_split and memory "
            "sections for what each column means.",
            *parts,
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    if smoke:
        print(f"--cpu-smoke: not writing RESULTS.md ({time.perf_counter() - began:.0f} s)")
        return 0
    path = write_section(section_name(run), body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
