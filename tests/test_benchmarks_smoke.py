"""Smoke runs of the benchmark scripts' core functions at toy sizes, so the scripts don't rot."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import auto_ticks  # noqa: E402
import balance  # noqa: E402
import buffers  # noqa: E402
import build_time  # noqa: E402
import bw_in_step  # noqa: E402
import bw_split  # noqa: E402
import compile_layers  # noqa: E402
import evaluation  # noqa: E402
import gpu  # noqa: E402
import in_context  # noqa: E402
import lockstep  # noqa: E402
import memory  # noqa: E402
import multiprocess  # noqa: E402
import multiprocess_unstage  # noqa: E402
import optimizer  # noqa: E402
import overlap  # noqa: E402
import slot_writes  # noqa: E402
import stash_reads  # noqa: E402
import step_time  # noqa: E402
import tensor_parallel  # noqa: E402

from models import gpt  # noqa: E402
from zbjax import schedules  # noqa: E402


def test_bw_split_times_an_mlp_stage_and_b_plus_w_flops_equal_bw():
    case = bw_split.reference_cases(bw_split.SMOKE_SIZES)[0]
    m = bw_split.measure(case, repeats=2)
    assert m.flops_b + m.flops_w == m.flops_bw > 0
    chained = bw_split.measure_prepared(case.label, bw_split.prepare(case), repeats=2, chain=3)
    assert chained.split_s > 0 and chained.fused_s > 0 and chained.ratio > 0
    with pytest.raises(ValueError, match="chain=0"):
        bw_split.measure_prepared(case.label, bw_split.prepare(case), repeats=2, chain=0)
    assert m.split_s > 0 and m.fused_s > 0 and m.ratio > 0
    assert m.unmerged_s is None and m.merge_ratio is None
    assert "| yes |" in bw_split.table([m], [m])


def test_bw_split_also_times_bw_as_jax_traced_it():
    case = bw_split.reference_cases(bw_split.SMOKE_SIZES)[2]
    assert case.label.startswith("GPT linen middle")
    p = bw_split.prepare(case, unmerged=True)

    def contracted(closed):
        return [
            len(e.params["dimension_numbers"][0][0])
            for e in closed.jaxpr.eqns
            if e.primitive.name == "dot_general"
        ]

    # The timed BW contracts one dimension per dot; as traced, the weight gradients two.
    assert set(contracted(p.program.backward)) == {1}
    as_traced = bw_split.split_stage(
        bw_split.partition(
            case.loss_fn, case.params, case.microbatch, num_stages=case.num_stages
        ).stages[case.stage_index],
        merge_contracting=False,
        unroll_scans=0,
    )
    assert 2 in contracted(as_traced.backward)
    m = bw_split.measure_prepared(case.label, p, repeats=2)
    assert m.unmerged_s > 0 and m.merge_ratio > 0
    assert f"| {m.unmerged_s * 1e3:.2f} | {m.merge_ratio:.3f} |" in bw_split.table([m])


def test_bw_split_times_the_mlp_stage_across_widths_next_to_its_stash_copies():
    widths = bw_split.SMOKE_WIDTHS
    measured = bw_split.measure_all(
        2, bw_split.width_cases(widths, bw_split.SMOKE_SIZES), copies=True
    )
    for width, m in zip(widths, measured, strict=True):
        assert m.label.startswith(f"MLP middle stage ({bw_split.SMOKE_SIZES.mlp_layers_per_stage}")
        assert f"Dense({width})" in m.label
        assert m.copy_s > 0 and m.ratio > 0
        assert m.copies_ratio == pytest.approx(1 + 2 * m.copy_s / m.fused_s)
        assert m.flops_b + m.flops_w == m.flops_bw > 0
    # The stash B writes for W (one cotangent per layer) doubles with the width.
    assert measured[1].new_stash_bytes == 2 * measured[0].new_stash_bytes
    assert bw_split.measurements_from_json(bw_split.measurements_json(measured)) == measured
    table = bw_split.width_table(widths, measured)
    assert table.count("\n") == 1 + len(widths)
    assert f"| {widths[0]} | " in table and f"| {measured[0].copies_ratio:.3f} |" in table
    # Without the copy timed, the copy columns say so.
    plain = dataclasses.replace(measured[0], copy_s=None)
    assert plain.copies_ratio is None
    assert "| – |" in bw_split.table([plain])
    main_table = bw_split.table([measured[0]], [measured[0]])
    assert main_table.count(f"| {measured[0].copies_ratio:.3f} |") == 2  # all cores, one core

    def at(*ratios):
        return [dataclasses.replace(m, ratio=r) for m, r in zip(measured, ratios, strict=True)]

    verdict = bw_split.widths_verdict
    assert verdict(widths, at(1.10, 1.04)).endswith(f"from width {widths[1]} on.")
    assert verdict(widths, at(1.04, 1.10)).endswith(f"at width {widths[0]} only.")
    assert verdict(widths, at(1.10, 1.07)).endswith("at none of them.")


def test_bw_in_step_times_split_against_fused_steps_that_differ_only_in_the_split():
    schedules_of = bw_in_step.variants()
    fused = schedules_of[bw_in_step.FUSED]
    m, n = bw_in_step.MICROBATCHES, bw_in_step.NUM_STAGES
    every = [(s, mb) for s in range(n) for mb in range(m)]
    for name in (bw_in_step.SPLIT, bw_in_step.DEFERRED):
        split = schedules_of[name]
        # One device runs every stage's F, B and W of every microbatch, no BW.
        assert len(split.actions) == 1
        acts = [(a.kind, a.stage, a.microbatch) for a in split.actions[0]]
        for kind in ("F", "B", "W"):
            assert sorted((s, mb) for k, s, mb in acts if k == kind) == every
        assert not any(k == "BW" for k, _, _ in acts)
        # Fused: every B of the split schedule is a BW where it stands, every W gone.
        assert [(a.kind, a.stage, a.microbatch) for a in fused.actions[0]] == [
            ("BW" if k == "B" else k, s, mb) for k, s, mb in acts if k != "W"
        ]
    # Deferred: microbatch 0's W run after microbatch 1's forwards.
    deferred = [(a.kind, a.microbatch) for a in schedules_of[bw_in_step.DEFERRED].actions[0]]
    assert deferred.index(("W", 0)) > max(i for i, a in enumerate(deferred) if a == ("F", 1))
    model = bw_in_step.reference_models(bw_split.SMOKE_SIZES)[0]
    result = bw_in_step.measure(model, rounds=2, profiles=1, steps=1)
    assert set(result.times) == set(schedules_of)
    assert all(len(t) == 2 and min(t) > 0 for t in result.times.values())
    assert result.backward_seconds() > 0
    for name in (bw_in_step.SPLIT, bw_in_step.DEFERRED):
        # On CPU the traces name every action, so every stage's ratio and the backward's exist.
        assert all(result.stage_ratio(name, s) > 0 for s in range(n))
        assert result.backward_ratio(name) is not None
        assert result.traced_extra_seconds(name) is not None
    rows = bw_in_step.table([result]).splitlines()[2:]
    assert len(rows) == 2
    for row, name in zip(rows, (bw_in_step.SPLIT, bw_in_step.DEFERRED), strict=True):
        cells = row.strip("| ").split(" | ")
        assert cells[:3] == [model.label, name, "2"] and len(cells) == 12 and "–" not in cells
    assert "Worst backward split / fused" in bw_in_step.target_line([result])


def test_stash_reads_times_transposes_and_w_both_ways():
    transposes, weights = stash_reads.measure(bw_split.SMOKE_SIZES, (2, 4, 8), repeats=2)
    assert set(transposes) == set(stash_reads.transpose_calls((2, 4, 8)))
    assert all(len(t) == 2 and min(t) > 0 for t in transposes.values())
    # Every reference stage but the first GPT stage, whose B writes W nothing.
    assert len(weights) == len(bw_split.reference_cases(bw_split.SMOKE_SIZES)) - 1
    for label, times in weights:
        assert set(times) == {"B", "W, reads fused", "W, reads apart", "BW"}
        assert stash_reads.weight_row(label, times).count("|") == 9
    assert "| (2, 4, 8) float32 |" in stash_reads.transpose_table((2, 4, 8), transposes)


def test_lockstep_rows_never_lose_to_packing_and_the_section_lists_them():
    costs = {"unit": schedules.Costs(1.0, 1.0, 0.5, 0.1)}
    results = lockstep.run(costs, device_counts=(4,), per_device=(1, 2), names=("1f1b", "zb-h1"))
    rows = results["unit"]
    assert [(r.name, r.num_microbatches) for r in rows] == [
        ("1f1b", 4),
        ("zb-h1", 4),
        ("1f1b", 8),
        ("zb-h1", 8),
    ]
    for r in rows:
        # Ticks never beat the event-driven makespan; choose_ticks keeps the best candidate.
        assert 1.0 - 1e-9 <= r.chosen <= r.packed <= r.plain
        assert r.segmented == (r.chosen < r.packed * (1 - 1e-9))
    assert any(r.segmented for r in rows)
    text = lockstep.section(results, took=1.0)
    assert text.count("\n| 4 |") == len(rows)


def test_buffers_times_every_variant_of_both_models_and_finds_the_pools_donated():
    rows = [buffers.measure(case, rounds=2) for case in buffers.cases(small=True)]
    for row in rows:
        assert set(row.times) == set(buffers.VARIANTS)
        assert all(len(t) == 2 and min(t) > 0 for t in row.times.values())
        assert row.alias_donated == row.pool_bytes > 0
    assert buffers.table(rows).count("\n") == 3 * len(rows) + 1


def test_in_context_profiles_every_variant_beside_the_costs_measured_alone():
    costs, results = in_context.measure(step_time.SMOKE_SETUP, repeats=2, steps=1)
    assert [r.name for r in results] == [name for name, _, _ in in_context.VARIANTS]
    assert all(len(r.profiles) == 2 for r in results)
    actions = in_context.action_table(costs, results)
    assert "| zb-h2, B and W split | W s1 | 1 |" in actions  # stage 1 kept split
    assert "| zb-h2, as planned | F s1 | 1 |" in actions and "| 1f1b | BW s0 | 0 |" in actions
    assert in_context.device_table(results).count("\n") == 2 + 3 * 2 - 1
    assert in_context.split_line(costs, results)


def test_slot_writes_times_every_action_of_every_stage_both_ways():
    case = slot_writes.cases(small=True)[0]
    rows = slot_writes.measure(case, repeats=2)
    assert [(r.stage, r.action) for r in rows] == [
        (s, a) for s in range(case.num_stages) for a in slot_writes.ACTIONS
    ]
    assert all(r.whole_ms > 0 and r.slots_ms > 0 and r.ratio > 0 for r in rows)
    assert slot_writes.table(rows).count("\n") == len(rows) + 1


def test_textbook_gpipe_equals_jax_grad():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (step_time.AXIS,))
    assert step_time.check_textbook(step_time.SMOKE_SETUP, mesh, 4) < 1e-5


@pytest.mark.parametrize("m", [2, 4])
def test_gpipe_lockstep_time_is_ticks_times_slowest_action(m):
    # gpipe on 2 devices: m + 1 forward ticks (cost F) then m + 1 backward ticks (cost B + W);
    # the first stage's m forwards and the last stage's m backwards send (2m exchanges).
    schedule = schedules.build("gpipe", 2, m)
    time_, ticks, exchanges = step_time.lockstep_time(schedule, schedules.Costs(1.0, 2.0, 3.0))
    assert ticks == 2 * (m + 1)
    assert exchanges == 2 * m
    assert time_ == pytest.approx((m + 1) * (1.0 + 5.0))


def test_alternate_times_every_variant_every_round_and_ratios_are_per_round():
    times = step_time.alternate({"a": lambda: 1, "b": lambda: 2}, rounds=3)
    assert [len(t) for t in times.values()] == [3, 3]
    times = {"a": [1.0, 2.0, 3.0], "b": [2.0, 2.0, 2.0]}
    assert step_time.median_ratio(times, "a", "b") == 1.0
    # The middle half of the per-round ratios 0.5, 1, 1.5, 2, 2.5: from 1 to 2.
    times = {"a": [1.0, 4.0, 2.0, 5.0, 3.0], "b": [2.0] * 5}
    assert step_time.ratio_quartiles(times, "a", "b") == pytest.approx((1.0, 2.0))
    assert step_time.ratio_quartiles({"a": [3.0], "b": [2.0]}, "a", "b") == (1.5, 1.5)


def _programs(num_stages, activation_bytes):
    return [
        SimpleNamespace(
            activation_bytes=activation_bytes,
            cost_forward=1.0,
            cost_backward_input=1.0,
            cost_backward_weight=1.0,
        )
        for _ in range(num_stages)
    ]


@pytest.mark.parametrize("m", [4, 8])
def test_predicted_peak_grows_with_m_for_gpipe_and_stays_at_p_for_1f1b(m):
    gpipe = schedules.build("gpipe", 4, m)
    one_f_one_b = schedules.build("1f1b", 4, m)
    assert memory.predicted_peak(gpipe, _programs(4, 100)) == (m, 100 * m)
    assert memory.predicted_peak(one_f_one_b, _programs(4, 100)) == (4, 400)


def test_scan_gpt_params_per_device_shrink_with_more_stages():
    text, held = memory.scan_params_per_device(memory.SMOKE_MODEL)
    assert "p = 2" in text and "p = 4" in text
    assert held[4] < 0.75 * held[2], held


def test_memory_rows_set_the_arenas_beside_the_equal_slots_they_replaced():
    # zb-h2 defers W: the last stage holds many kept items and stashes, the first stage few
    # but larger ones; equal slots take the largest item times the most in flight per kind.
    mesh = jax.make_mesh((4,), (memory.AXIS,), devices=jax.devices()[:4])
    row = memory.measure("zb-h2", 16, memory.SMOKE_MODEL, mesh)
    assert 0 < row.ring_bytes < row.slot_bytes
    assert row.temp_bytes >= row.ring_bytes
    line = memory.table([row]).splitlines()[-1]
    assert line.count("|") == 11 and f"| {row.slot_bytes / 1e3:.0f} |" in line


def test_memory_sentences_on_what_the_backward_computes_again_measure_a_saving():
    casts, masks = (
        f(memory.SMOKE_MODEL) for f in (memory.mixed_precision_sizes, memory.mask_sizes)
    )
    assert "recompute_parameter_casts=False" in casts and "% less" in casts
    assert "recompute_constants=False" in masks
    more = float(masks.split("(")[-1].split(" kB more")[0])
    assert more > 0, masks


def test_optimizer_benchmark_times_every_variant_against_adamw_on_the_rows():
    tiny = optimizer.Case(
        "tiny GPT", gpt.GPTConfig(num_layers=2, d_model=16, seq_len=8, vocab_size=32), 2, 4
    )
    rows = optimizer.measure(tiny, rounds=2)
    assert len(rows) == 4 and len({r.variant for r in rows}) == 4
    assert all(r.update_ms > 0 and r.compile_s > 0 and r.step_ms > 0 for r in rows)
    assert rows[0].variant == optimizer.BASELINE and rows[0].ratio == 1.0
    text = optimizer.section(rows, 2, ("before", "after"), 1.0)
    assert text.count("| tiny GPT |") == 4 and "Slowest per_leaf update" in text


def test_tensor_parallel_benchmark_halves_params_per_device_and_matches_value_and_grad():
    tiny = gpt.GPTConfig(num_layers=2, d_model=16, seq_len=8, vocab_size=32)
    rows = tensor_parallel.measure(1, tiny, 8, ((2, 2, 1), (2, 1, 2)))
    assert [(r.model, r.mesh) for r in rows] == [
        (model, mesh)
        for model in ("loop", "scan")
        for mesh in ("pp 2 x dp 2", "pp 2 x dp 1 x tp 2")
    ]
    for plain, split in (rows[:2], rows[2:]):
        assert split.param_bytes < 0.8 * plain.param_bytes and plain.ratio == 1.0
        assert split.collectives["all-gather"] == 0  # every slot keeps each device's part
    assert all(r.grad_diff < 1e-5 and r.step_ms > 0 for r in rows)
    text = tensor_parallel.section(rows, 1, ("before", "after"), 1.0)
    assert "| scan | pp 2 x dp 1 x tp 2 |" in text


def _smoke_main(module, argv, monkeypatch, capsys):
    """Returns (the flags each worker got, worker 0's result, stdout) of ``module.main(argv)``
    with --smoke, failing if it writes RESULTS.md: the top level passed no --smoke to the
    workers (multiprocess.py, overlap.py), so the full benchmark ran and was written."""
    import _results

    launched = []
    launch_workers = _results.launch_workers

    def recording(script, args, num_workers, timeout_s):
        launched.append((list(args), launch_workers(script, args, num_workers, timeout_s)))
        return launched[-1][1]

    def no_write(name, body, path=None):
        raise AssertionError(f"--smoke wrote the section {name!r} of RESULTS.md")

    monkeypatch.setattr(_results, "launch_workers", recording)
    monkeypatch.setattr(_results, "write_section", no_write)
    assert module.main([*argv, "--smoke"]) == 0
    [(flags, result)] = launched
    out = capsys.readouterr().out
    assert "--smoke" in flags and "--smoke: not writing RESULTS.md" in out
    return flags, result, out


def test_multiprocess_benchmark_runs_two_pinned_processes_and_formats_its_section(
    monkeypatch, capsys
):
    argv = ["--rounds", "1", "--microbatches", "2"]
    _, result, _ = _smoke_main(multiprocess, argv, monkeypatch, capsys)
    assert result["ppermute_ms"] > 0 and len(result["costs_ms"][0]) == 2
    rows = result["m"]["2"]
    assert set(rows) == set(multiprocess.VARIANTS) and rows["1f1b"]["ratio"] == 1.0
    text = multiprocess.section(result, 1, [2], 1.0)
    rows_of_m = [line for line in text.splitlines() if line.startswith("| 2 | ")]
    assert len(rows_of_m) == len(multiprocess.VARIANTS)
    profiled = result["profiled"]
    assert set(profiled) == set(multiprocess.PROFILED)
    for prof in profiled.values():  # both processes' devices, each with time in its actions
        assert len(prof["devices"]) == 2 and all(row[2] > 0 for row in prof["devices"])
        assert {"F s0", "F s1"} <= set(prof["per_run"])
    assert "**In context** (m = 2" in text and "| zb-h2 | F s1 |" in text
    # The in-step costs: each stage's F, B, W, BW as the profiled steps ran them, planning a
    # variant of their own and timing every variant's ticks in two more columns.
    in_step = result["in_step_costs_ms"]
    assert len(in_step) == 4 and all(len(c) == 2 and min(c) > 0 for c in in_step)
    assert in_step[0][1] == pytest.approx(profiled["1f1b"]["per_run"]["F s1"])
    assert "(in-step)" in text and f"| 2 | {multiprocess.IN_STEP} |" in text


def test_multiprocess_unstage_runs_two_processes_and_counts_hangs_in_its_section():
    results = multiprocess_unstage.run(1, 2, ("one program",))
    assert len(results["one program"]) == 1 and results["one program"][0] > 0
    text = multiprocess_unstage.section(
        {"one program": [1.0, 3.0, 2.0], "eager slices": [None, 2.5, None]}, 3, 2, took=1.0
    )
    assert "| one program | 3 | 0 | 2.00 |" in text and "| eager slices | 3 | 2 | 2.50 |" in text


def test_overlap_benchmark_times_every_variant_in_two_pinned_processes(monkeypatch, capsys):
    _, times, out = _smoke_main(overlap, ["--rounds", "2"], monkeypatch, capsys)
    assert set(times) == set(overlap.VARIANTS)
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in times.values())
    text = overlap.section(times, 2, 1.0)
    assert all(f"| {name} |" in text for name in overlap.VARIANTS)


def test_gpu_kernels_are_read_off_the_stream_lines_of_a_perfetto_trace(tmp_path):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {
            "ph": "M",
            "pid": 1,
            "tid": 7,
            "name": "thread_name",
            "args": {"name": "Stream #14(Compute)"},
        },
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 9, "tid": 3, "name": "thread_name", "args": {"name": "Stream host"}},
    ]
    gemm = "sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n"
    events = [
        {"ph": "X", "pid": 1, "tid": 7, "name": gemm, "dur": 300.0, "args": {"hlo_op": "cb_1"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "dur": 60.0, "args": {}},
        {"ph": "X", "pid": 1, "tid": 8, "name": "jit_step", "dur": 999.0},  # a summary line
        {"ph": "X", "pid": 9, "tid": 3, "name": "cublas_host_call", "dur": 999.0},  # host
    ]
    trace = tmp_path / "plugins" / "profile" / "run"
    trace.mkdir(parents=True)
    with gzip.open(trace / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    kernels = gpu.device_kernels(tmp_path)
    assert kernels == [(gemm, "cb_1", 300.0), ("loop_add_fusion", "", 60.0)]
    assert [bool(gpu.GEMM_KERNEL.search(k)) for k, _, _ in kernels] == [True, False]


def test_gpu_script_refuses_politely_without_a_gpu(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert gpu.main([]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err


def test_gpu_script_runs_the_parts_named_and_refuses_unknown_ones(capsys):
    assert gpu.chosen_parts("memory, in-step") == ("in-step", "memory")  # in running order
    assert gpu.section_name(gpu.PARTS) == "gpu"
    assert gpu.section_name(("in-step", "memory")) == "gpu-in-step-memory"
    for bad in ("in-step,bogus", " , "):
        with pytest.raises(ValueError, match="name some of tick, split, in-step"):
            gpu.chosen_parts(bad)
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--parts", "bogus"])
    assert exit_info.value.code == 2
    assert "unknown bogus" in capsys.readouterr().err


def test_gpu_step_time_part_times_every_schedule_and_predicts_from_in_step_costs():
    # gpu.py's part for 2 or more GPUs, at toy sizes on 2 CPU devices.
    text = gpu.step_time_section(step_time.SMOKE_SETUP, m=4, rounds=2, profile_steps=1)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][1:]
    assert [row[0][2:] for row in rows] == list(gpu.STEP_SCHEDULES)
    one = rows[gpu.STEP_SCHEDULES.index("1f1b")]
    assert one[2:7] == ["1.000"] * 5  # measured and all four predictions, against itself
    assert all(float(row[1]) > 0 for row in rows)
    # On CPU the trace names every action: all of them timed in the step. zb-h2 kept split
    # runs B and W of stage 1 (stage 0's backward may run fused: its B has nothing to do).
    timed = re.search(r"actions timed: 1f1b (\d+) of (\d+), zb-h2 (\d+) of (\d+);", text)
    assert timed and timed[1] == timed[2] == "4" and timed[3] == timed[4] in ("5", "6"), text


def test_build_time_splits_the_alike_middle_stages_once_and_tables_both_ways():
    builds = build_time.measure([8], 1, build_time.SMOKE_SIZES)
    by = {b.variant: b for b in builds}
    assert set(by) == set(build_time.VARIANTS)
    assert by["every stage split"].programs_split == by["every stage split"].stages == 8
    # Embedding and head stages differ from the blocks between them; the cost model's cuts of
    # this tiny GPT leave some middle stages one program.
    once = by["alike stages split once"].programs_split
    assert 3 <= once < 8
    assert all(b.lower_s > b.split_s > 0 for b in builds)
    assert re.search(
        rf"^\| 8 \| {once} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|", build_time.table(builds, [8]), re.M
    )


def test_compile_layers_times_both_steps_and_counts_the_kernels_offsets_set_apart():
    (row,) = compile_layers.measure([8], 1)
    assert min(row.pipelined_s, row.unpipelined_s, row.per_leaf_s, row.optax_s) > 0
    # Every layer's kernels read their params at offsets of their own: fewer kernels are
    # distinct once constants and slice bounds are set aside.
    assert row.kernels > row.distinct > row.distinct_but_constants > 0
    assert re.search(
        r"^\| 8 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+x \|", compile_layers.table([row]), re.M
    )
    separate, sliced = compile_layers.slices_against_arrays(count=4, size=8)
    assert separate > 0 and sliced > 0


def test_evaluation_times_value_against_value_and_grads_loss():
    cfg = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=2)
    (row,) = evaluation.measure(["1f1b"], 1, cfg)
    assert row[0] == "1f1b" and row[1] > 0 and row[2] > 0 and row[3] > 0
    # The forwards alone keep no residuals: fewer temporary bytes than the training step.
    assert 0 < row[4] < row[5]
    assert re.search(
        r"^\| 1f1b \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ / [0-9.]+ \|$",
        evaluation.table([row]),
        re.M,
    )


def test_auto_ticks_rows_run_the_fastest_candidate_and_the_section_counts_the_losses():
    rows = auto_ticks.run(shapes=((2, 4), (2, 8)), seeds=4, profiles=False)
    assert [(r.num_devices, r.num_microbatches) for r in rows] == [(2, 4)] * 4 + [(2, 8)] * 4
    for r in rows:
        assert r.chosen_time <= min(r.search, r.best_named) * (1 + 1e-9)
        assert r.chosen == "search" or r.search > r.chosen_time
    lost = sum(r.search > 1.01 * r.best_named for r in rows)
    text = auto_ticks.section(rows, took=1.0)
    assert f"more than 1 % slower in ticks than the best named order in {lost} of 8 rows" in text
    assert text.count("\n| random, seed ") == len(rows)


def test_run_all_reruns_every_section_with_the_command_that_made_it():
    """run_all.sh ran every script with its defaults, while 7 sections were made with other
    flags (compile_time --repeats 3, step_time --rounds 21, ...): rerunning them all did not
    reproduce RESULTS.md's commands."""
    here = Path(__file__).resolve().parents[1] / "benchmarks"
    made_by = dict(
        re.findall(
            r"Made by `python benchmarks/(\w+\.py) ?([^`]*)`", (here / "RESULTS.md").read_text()
        )
    )
    runs = dict(
        re.findall(r"\brun benchmarks/(\w+\.py) ?([^;\n]*)", (here / "run_all.sh").read_text())
    )
    scripts = {p.name for p in here.glob("*.py") if not p.name.startswith("_")}
    assert set(made_by) == set(runs) == scripts
    assert {name: runs[name].strip() for name in runs} == made_by


def test_balance_cuts_a_scan_mlp_with_a_bytes_weight_and_times_its_stages():
    flops, moved = balance.machine_balance(repeats=1)
    assert len(flops) == len(balance.MATMUL_WIDTHS) and all(f > 0 for _, f in flops)
    assert len(moved) == len(balance.ELEMENTWISE_SIZES) and all(b > 0 for _, b in moved)
    cut = balance.cut_balance("decay", 3.0, balance.SMOKE_MLP, repeats=1)
    assert len(cut["layers"]) == balance.DEVICES and cut["measured"] >= 1.0
    assert cut["layers"][-1] == balance.SMOKE_MLP["layers"]  # the decay reads the whole stack


def test_balance_times_the_ring_exchange_and_the_vocabulary_cuts():
    from zbjax import cost_model

    ring = balance.exchange_rate(repeats=1)
    assert [b for b, _ in ring] == list(balance.MESSAGE_SIZES) and all(t > 0 for _, t in ring)
    vocab = balance.vocab_cuts(balance.SMOKE_VOCAB_GPT, repeats=1)
    assert list(vocab) == ["no byte weight", "byte weight", "markers"]
    # Without the weight on bytes crossing, the cut sends the logits; with it, it does not.
    g = balance.SMOKE_VOCAB_GPT
    logits = g["batch"] // balance.MICROBATCHES * g["seq_len"] * g["vocab_size"] * 4
    assert vocab["no byte weight"]["edge"] >= logits > vocab["byte weight"]["edge"]
    lines = balance.comm_lines(ring, 100.0, vocab)
    assert any("`cost_model.CPU_COMM_WEIGHT`, set from such a run, is" in x for x in lines)
    assert any(f"`CPU_COMM_WEIGHT` = {cost_model.CPU_COMM_WEIGHT:g}" in x for x in lines)
