"""Step time with one core per device: two processes, each pinned to its own core, one device each.

``step_time.py`` runs its two devices as fake devices of one process, where they share XLA's
thread pool and both cores. Here each device is a separate process pinned to one core and joined
by ``jax.distributed`` over gloo (TCP on this machine), the setting the step-time target
assumes: a device computes on one core, so a bubble is a core left idle. The model is
``step_time``'s MLP (2 stages of 8 Dense(128) layers, 1024 rows per microbatch).

Process 0 reports: the step time of gpipe, 1f1b and zb-h2, the latter two also unpacked and zb-h2
also with W's stash in slots of its own (alternating rounds, medians, ratio to 1f1b within each
round); the stage costs F, B, W measured on its one core alone (as
``step_time.measured_costs`` does); the simulator's predicted ratio from those costs; and the
cost of one tick's ``ppermute`` of a microbatch's activations between the processes, which a
pipeline step pays once per tick that sends a message; profiles of 1f1b and zb-h2 in both
processes at the first m (``pipe.profile``), each action's time in the step against alone, and
the in-step costs they give (``ActionTimes.costs``), which time every variant's ticks again and
plan one more zb-h2. Writes the section "multiprocess" of
``benchmarks/RESULTS.md``.

Run: ``python benchmarks/multiprocess.py [--rounds N] [--microbatches 4 8]``.
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
from typing import Any

COMMAND = "python benchmarks/multiprocess.py"
SCHEDULE_NAMES = ("gpipe", "1f1b", "zb-h2")
#: The same schedules as built, one action per device per tick, in the same rounds.
UNPACKED = ("1f1b, pack_ticks=False", "zb-h2, pack_ticks=False")
#: zb-h2 with W's stash in an arena of its own instead of where B reads its residuals (over
#: them, or in one arena shared by every kind: ``zbjax.lower.OVERLAY_MIN_SAVING`` turned off):
#: what that memory saving costs in time.
STASH_SLOTS = "zb-h2, stash slots"
#: zb-h2 given the costs without the fused backward's, so that no stage with a B to compute
#: runs fused (``step_time.SPLIT``).
SPLIT = "zb-h2, B and W split"
#: zb-h2 planned by the in-step costs: each action's time inside the step, read off the
#: profiles of 1f1b and zb-h2 (``ActionTimes.costs``), instead of its time alone.
IN_STEP = "zb-h2, planned by in-step costs"
VARIANTS = (*SCHEDULE_NAMES, *UNPACKED, STASH_SLOTS, SPLIT, IN_STEP)
NUM_PROCESSES = 2
TIMEOUT_S = 900
#: Schedules profiled in context (``pipe.profile``) at the first microbatch count, as planned;
#: in this order, so that the in-step costs take F and BW from 1f1b's profile.
PROFILED = ("zb-h2", "1f1b")
#: Steps each profile times untraced and then traces.
PROFILE_STEPS = 5


def worker(
    process_id: int, port: int, rounds: int, microbatches: Sequence[int], out: str, smoke: bool
) -> None:
    """Runs one process: pins it to core ``process_id``, joins the other, times the steps."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[process_id]})
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=process_id
    )
    import numpy as np
    from jax.experimental import multihost_utils

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_time

    import zbjax
    from models import mlp
    from zbjax import schedules
    from zbjax.profile import measure_exchange_costs

    setup = step_time.SMOKE_SETUP if smoke else step_time.Setup()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), (step_time.AXIS,))
    cfg = step_time.mlp_config(setup, NUM_PROCESSES)
    params = jax.tree.map(np.asarray, mlp.init_params(jax.random.key(0), cfg))
    loss_fn = mlp.make_loss_fn(cfg)
    micro = jax.tree.map(np.asarray, mlp.make_batch(jax.random.key(1), cfg, setup.microbatch_rows))
    local = jax.local_devices()[0]
    # Stage costs on this process's one core. Both processes measure at once, each on its own
    # core, as they will compute in the pipeline.
    costs = step_time.measured_costs(
        loss_fn, jax.device_put(params, local), jax.device_put(micro, local), 2 if smoke else 30
    )
    # One tick's exchange as the lowering does it (a microbatch's activations, ppermuted both
    # ways), timed over 100 ticks in a loop; a collective, so both processes time it at once.
    probe = zbjax.pipeline(
        loss_fn,
        mesh=mesh,
        axis_name=step_time.AXIS,
        schedule="1f1b",
        num_microbatches=microbatches[0],
    )
    probe.stage(
        params,
        jax.tree.map(
            np.asarray,
            mlp.make_batch(jax.random.key(1), cfg, microbatches[0] * setup.microbatch_rows),
        ),
    )
    # And with two messages each way, as a tick whose exchange carries two does it.
    comm, comm_message = measure_exchange_costs(probe.lowering, repeats=10, ticks=100)
    # The pipelines plan their ticks by these costs, an exchange costing comm plus
    # comm_message per further message, and every process must build the same program: all
    # take process 0's.
    shared = multihost_utils.broadcast_one_to_all(
        np.array([*costs.f, *costs.b, *costs.w, *costs.bw, comm, comm_message])
    )
    n = len(costs.f)
    values = [float(x) for x in np.asarray(shared)]
    f, b, w, bw = (tuple(values[k * n : (k + 1) * n]) for k in range(4))
    costs = schedules.Costs(f, b, w, values[-2], bw=bw, comm_message=values[-1])
    result: dict = {
        "costs_ms": [[1e3 * x for x in c] for c in (costs.f, costs.b, costs.w, costs.bw)]
    }
    result["ppermute_ms"] = 1e3 * costs.comm
    result["comm_message_ms"] = 1e3 * costs.comm_message
    # Profiled first, so that the in-step costs can plan a variant and time every prediction.
    result["profiled"], in_step = profile_in_context(
        loss_fn, params, cfg, setup, mesh, costs, microbatches[0], 1 if smoke else PROFILE_STEPS
    )
    result["in_step_costs_ms"] = [
        [1e3 * x for x in c] for c in (in_step.f, in_step.b, in_step.w, in_step.bw)
    ]
    result["m"] = {}
    for m in microbatches:
        batch = jax.tree.map(
            np.asarray, mlp.make_batch(jax.random.key(1), cfg, m * setup.microbatch_rows)
        )
        variants, predicted = {}, {}
        for name in VARIANTS:
            pack = name not in UNPACKED
            schedule = schedules.build(
                name.split(",")[0], NUM_PROCESSES, m, num_devices=NUM_PROCESSES
            )
            overlay = zbjax.lower.OVERLAY_MIN_SAVING
            if name == STASH_SLOTS:
                zbjax.lower.OVERLAY_MIN_SAVING = float("inf")  # never overlaid
            given = {SPLIT: step_time.split_costs(costs), IN_STEP: in_step}.get(name, costs)
            try:  # the slot layout is chosen when the step is built, here
                variants[name] = step_time.pipeline_step(
                    loss_fn, schedule, mesh, params, batch, costs=given, pack_ticks=pack
                )
            finally:
                zbjax.lower.OVERLAY_MIN_SAVING = overlay
            # The ticks the pipeline planned, timed by the costs alone and by the in-step ones.
            predicted[name] = step_time.predict(schedule, costs, pack=pack, plan_costs=given)
            predicted[name, IN_STEP] = step_time.predict(
                schedule, in_step, pack=pack, plan_costs=given
            )
        times = step_time.alternate(variants, rounds)
        result["m"][m] = {
            name: {
                "step_ms": 1e3 * statistics.median(times[name]),
                "ratio": step_time.median_ratio(times, name, "1f1b"),
                "quartiles": step_time.ratio_quartiles(times, name, "1f1b"),
                "makespan_ms": 1e3 * predicted[name].makespan,
                "lockstep_ms": 1e3 * predicted[name].lockstep,
                "ticks": predicted[name].ticks,
                "exchanges": predicted[name].exchanges,
                "comm_ms": 1e3 * predicted[name].comm,
                "fused": list(predicted[name].fused),
                "in_step_makespan_ms": 1e3 * predicted[name, IN_STEP].makespan,
                "in_step_lockstep_ms": 1e3
                * (predicted[name, IN_STEP].lockstep + predicted[name, IN_STEP].comm),
            }
            for name in VARIANTS
        }
    if process_id == 0:
        Path(out).write_text(json.dumps(result))


def profile_in_context(
    loss_fn, params, cfg, setup, mesh, costs, m: int, steps: int
) -> tuple[dict, Any]:
    """Returns, per profiled schedule, what ``pipe.profile`` saw on each process's device
    (the step untraced and traced, its time in actions, exchanges and between actions, and
    every action's time per run in ms), gathered from both processes (a collective: both call
    it); and the in-step costs: ``costs`` with each action's time as it ran in the step, F
    and BW from 1f1b's profile, B and W from zb-h2's (``ActionTimes.costs``)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_time

    import zbjax
    from models import mlp
    from zbjax import schedules
    from zbjax.trace import BETWEEN, EXCHANGES, ActionTimes

    scopes = [f"{k} s{s}" for s in range(NUM_PROCESSES) for k in ("F", "B", "W", "BW")]
    batch = jax.tree.map(
        np.asarray, mlp.make_batch(jax.random.key(1), cfg, m * setup.microbatch_rows)
    )
    out, in_step = {}, costs
    for name in PROFILED:
        pipe = zbjax.pipeline(
            loss_fn,
            mesh=mesh,
            axis_name=step_time.AXIS,
            schedule=schedules.build(name, NUM_PROCESSES, m, num_devices=NUM_PROCESSES),
            num_microbatches=m,
            costs=costs,
        )
        times = pipe.profile(pipe.stage(params, batch), batch, steps=steps)
        ((device, local),) = times.seconds.items()  # this process traced its one device
        actions = times.action_seconds(device)
        row = [
            times.step_seconds,
            times.traced_step_seconds,
            actions,
            local.get(EXCHANGES, 0.0),
            local.get(BETWEEN, 0.0),
            *(
                local[scope] / times.runs[scope]
                if scope in local and scope in times.runs
                else float("nan")
                for scope in scopes
            ),
        ]
        gathered = np.asarray(multihost_utils.process_allgather(1e3 * np.array(row)))
        # Both processes' actions, as if one profile had seen both devices.
        both = ActionTimes(
            1,
            {
                p: {
                    scope: r[5 + k] * 1e-3 * times.runs[scope]
                    for k, scope in enumerate(scopes)
                    if not np.isnan(r[5 + k])
                }
                for p, r in enumerate(gathered)
            },
            times.runs,
        )
        in_step = both.costs(in_step)
        out[name] = {
            "devices": [list(map(float, r[:5])) for r in gathered],
            "per_run": {
                scope: float(np.nanmax(gathered[:, 5 + k]))
                for k, scope in enumerate(scopes)
                if not np.all(np.isnan(gathered[:, 5 + k]))
            },
        }
    return out, in_step


def launch(rounds: int, microbatches: Sequence[int], smoke: bool = False) -> dict:
    """Returns process 0's results after running both processes of this script (``smoke``:
    ``step_time``'s toy MLP, to check that the script runs)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import launch_workers

    args = ["--rounds", str(rounds), "--microbatches", *map(str, microbatches)]
    return launch_workers(__file__, args + (["--smoke"] if smoke else []), NUM_PROCESSES, TIMEOUT_S)


def section(result: dict, rounds: int, microbatches: Sequence[int], took: float) -> str:
    """Returns the markdown of the "multiprocess" section."""
    from _results import machine_load
    from step_time import stages_text

    f, b, w, bw = result["costs_ms"]
    fi, bi, wi, bwi = result["in_step_costs_ms"]
    lines = [
        "## Step time with one core per device: two pinned processes over jax.distributed",
        "",
        f"Made by `{COMMAND} --rounds {rounds} --microbatches "
        f"{' '.join(map(str, microbatches))}`: 2 processes, each pinned to its own core with one "
        "CPU device, joined by `jax.distributed` (gloo over TCP); `step_time`'s MLP (2 stages of 8 "
        "Dense(128), 1024 rows per microbatch). Stage costs measured on one core alone: "
        + "; ".join(
            f"stage {s}: F {f[s]:.2f} / B {b[s]:.2f} / W {w[s]:.2f} / fused BW {bw[s]:.2f} ms"
            for s in range(len(f))
        )
        + f". One tick's `ppermute` of a microbatch's activations (512 kB each way) between the "
        f"processes: {result['ppermute_ms']:.2f} ms; what a second microbatch's adds, as in a "
        "tick whose exchange carries two messages (1 MB each way; the measured difference, at "
        f"least 0): {result['comm_message_ms']:.2f} ms. "
        f"Steps alternate round by round ({rounds} "
        "rounds); step is the median, measured / 1f1b the median of the ratio within a round, "
        "rounds' middle half its first to third quartile over the rounds; "
        "predicted = the simulator's makespan ratio from the one-core costs, the ppermute as "
        "the delay of every message between the devices; lockstep + comm = the lowering's ticks, "
        "the devices running their actions back to back and waiting for each other only at the "
        "ticks that send a message, each of which pays its ppermute, of one or of two messages "
        "(the others skip it; `zbjax.ticks.barrier_time`). The pipelines get these costs, the "
        "one-message ppermute as `comm` and what the second message adds as `comm_message` "
        "(`pipeline(costs=...)`), and pack actions into a tick's spare time after a "
        "short one (W, and F, B or BW whose messages came at an earlier tick), or place the "
        "exchanges first (`zbjax.ticks.segment_ticks`), where they say it pays, each exchange "
        "costing its ppermute (and run a stage's backward fused where that shortens the "
        "ticks: the first stage's, its B having nothing to compute, and any other whose B and "
        "W cost more than its fused BW by more than deferring W saves; *stages run fused* "
        "lists them); "
        f"*{UNPACKED[0]}* and *{UNPACKED[1]}* run "
        f"one action per device per tick, as built; *{STASH_SLOTS}* keeps W's stash in an "
        "arena of its own instead of writing it into the one B reads its residuals from (over "
        "the residuals only B read, or in one arena shared by every kind, which the lowering "
        "takes where that holds at least 10 % fewer bytes); "
        f"*{SPLIT}* gets the costs without the fused backward's (BW costing B + W), so the "
        "planner keeps every stage with a B to compute split (predicted: ticks planned by "
        "those costs, timed by the measured ones). *In-step costs*: each action's time inside "
        f"the step, from the profiles below (m = {microbatches[0]}; F and BW as 1f1b's step "
        "ran them, B and W as zb-h2's, where it split a stage; `ActionTimes.costs`): "
        + "; ".join(
            f"stage {s}: F {fi[s]:.2f} / B {bi[s]:.2f} / W {wi[s]:.2f} / fused BW {bwi[s]:.2f} ms"
            for s in range(len(fi))
        )
        + f"; the *(in-step)* columns time each variant's ticks by them, and *{IN_STEP}* is "
        "planned by them too.",
        "",
        "| m | schedule | step (ms) | measured / 1f1b | rounds' middle half | predicted / 1f1b "
        "| lockstep + comm / 1f1b | predicted / 1f1b (in-step) | lockstep + comm / 1f1b "
        "(in-step) | predicted step (ms, lockstep + comm) | ticks | exchanges "
        "| stages run fused (BW) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in microbatches:
        rows = result["m"][str(m)]
        base = rows["1f1b"]

        def lock(row: dict) -> float:
            return row["lockstep_ms"] + row["comm_ms"]

        for name in VARIANTS:
            row = rows[name]
            lines.append(
                f"| {m} | {name} | {row['step_ms']:.1f} | {row['ratio']:.3f} | "
                f"{row['quartiles'][0]:.3f}–{row['quartiles'][1]:.3f} | "
                f"{row['makespan_ms'] / base['makespan_ms']:.3f} | {lock(row) / lock(base):.3f} | "
                f"{row['in_step_makespan_ms'] / base['in_step_makespan_ms']:.3f} | "
                f"{row['in_step_lockstep_ms'] / base['in_step_lockstep_ms']:.3f} | "
                f"{lock(row):.1f} | {row['ticks']} | {row['exchanges']} | "
                f"{stages_text(row['fused'])} |"
            )
    lines += ["", *profiled_lines(result, microbatches[0])]
    lines += ["", f"Machine load at the end: `{machine_load()}`. Took {took:.0f} s."]
    return "\n".join(lines)


def profiled_lines(result: dict, m: int) -> list[str]:
    """Returns the markdown of the in-context profiles: per schedule and process, the step and
    where its traced time went; per action, its time in the step against alone."""
    from zbjax.schedules import Costs
    from zbjax.trace import scope_cost

    f, b, w, bw = (tuple(c) for c in result["costs_ms"])
    costs_ms = Costs(f, b, w, bw=bw)
    lines = [
        f"**In context** (m = {m}; `pipe.profile` in both processes at once, {PROFILE_STEPS} "
        "steps timed, then traced with `jax.profiler`; each action's time: the time its "
        "ops cover, overlaps split, by its named scope, `zbjax.trace`; exchanges include "
        "waiting for the other process; step: the median untraced step, traced step: the "
        "mean traced step, the basis of the times per step; *sum / traced step*: how much "
        "of it the ops' events cover):",
        "",
        "| schedule | process | step (ms) | traced step (ms) | actions (ms) | exchanges (ms) | "
        "between actions (ms) | sum / traced step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, prof in result["profiled"].items():
        for process, row in enumerate(prof["devices"]):
            cover = sum(row[2:5]) / row[1]
            cells = " | ".join(f"{v:.1f}" for v in row)
            lines.append(f"| {name} | {process} | {cells} | {cover:.2f} |")
    lines += [
        "",
        "| schedule | action | in the step (ms per run) | alone (ms) | in the step / alone |",
        "|---|---|---|---|---|",
    ]
    for name, prof in result["profiled"].items():
        for scope, ms in prof["per_run"].items():
            lines.append(
                f"| {name} | {scope} | {ms:.2f} | {scope_cost(costs_ms, scope):.2f} | "
                f"{ms / scope_cost(costs_ms, scope):.2f} |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_worker_flags

    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.port, args.rounds, args.microbatches, args.out, args.smoke)
        return 0
    began = time.perf_counter()
    result = launch(args.rounds, args.microbatches, smoke=args.smoke)
    from _results import write_section

    body = section(result, args.rounds, args.microbatches, time.perf_counter() - began)
    print(body)
    if args.smoke:  # toy sizes, which the section does not describe (as gpu.py --cpu-smoke)
        print("--smoke: not writing RESULTS.md")
        return 0
    print(f"wrote {write_section('multiprocess', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
