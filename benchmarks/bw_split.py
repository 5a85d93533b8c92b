"""Does splitting a stage's backward into B and W cost time? B-then-W versus the fused BW.

For one stage of each reference model (MLP, GPT linen first/middle/last stage, the scanned GPT's
middle stage), times B followed by W (two separately jitted calls, as the pipeline runs them)
against the fused backward BW (one jitted call), in one process, alternating the two, and
reports the median ratio together with the matmul FLOPs of B, W and BW (B + W must equal BW:
nothing is recomputed). Then, on one core, the MLP stage at several widths, next to what
copying B's stash for W into a slot and out of it costs. Writes the section "bw_split" of
``benchmarks/RESULTS.md``.

Run: ``python benchmarks/bw_split.py [--repeats N] [--widths 128 256 512 1024]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import jax
from jax.extend.core import jaxpr_as_fun

from zbjax.cost_model import matmul_flops
from zbjax.partition import partition
from zbjax.profile import (
    LOOP_RUNS,
    LOOP_SLOTS,
    looped,
    lowered_b_and_w,
    stage_arguments,
    stash_forwarded,
    weight_apart,
)
from zbjax.split import UNROLL_SCAN_LENGTH, split, split_stage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, pin_to_one_core, run_pinned_copy, write_section  # noqa: E402

COMMAND = "python benchmarks/bw_split.py"
TARGET_RATIO = 1.05
#: The MLP stage's widths timed on one core (``width_cases``): the split's extra work is
#: memory traffic that grows with the width, its matmuls with its square.
WIDTHS = (128, 256, 512, 1024)
SMOKE_WIDTHS = (8, 16)


@dataclass(frozen=True)
class Case:
    """One stage to time: a model's loss, its params and ONE microbatch, and which stage."""

    label: str
    loss_fn: Callable[..., Any]
    params: Any
    microbatch: Any
    num_stages: int | None
    stage_index: int


@dataclass(frozen=True)
class Measurement:
    """Median times (seconds) of B then W and of BW, their median per-pair ratio, and FLOPs."""

    label: str
    split_s: float
    fused_s: float
    b_s: float
    w_s: float
    ratio: float
    flops_b: int
    flops_w: int
    flops_bw: int
    stash_bytes: int
    activation_bytes: int
    new_stash_bytes: int
    repeats: int
    # BW as JAX traced it (``split_stage(merge_contracting=False, unroll_scans=0)``), timed
    # in the same rounds, and the median over rounds of BW / that; None where not measured.
    unmerged_s: float | None = None
    merge_ratio: float | None = None
    # One copy of the stash values B writes for W into a pool slot (``copy_seconds``); None
    # where not measured.
    copy_s: float | None = None

    @property
    def copies_ratio(self) -> float | None:
        """1 + two copies of the new stash over BW: the ratio if the split's only extra work
        were B copying those values into a slot and W copying them out of one."""
        return None if self.copy_s is None else 1 + 2 * self.copy_s / self.fused_s


@dataclass(frozen=True)
class Sizes:
    """Model sizes for the cases: GPT width/seq/batch/blocks per stage, MLP width/batch/depth."""

    gpt_width: int = 256
    gpt_heads: int = 4
    gpt_seq: int = 128
    gpt_vocab: int = 256
    gpt_batch: int = 8
    blocks_per_stage: int = 2
    mlp_width: int = 256
    mlp_layers_per_stage: int = 4
    mlp_batch: int = 512
    gpt_dtype: str = "float32"  # the GPTs' compute dtype (``GPTConfig.dtype``)


SMOKE_SIZES = Sizes(16, 2, 8, 32, 2, 1, 16, 1, 4)


def mlp_case(width: int, layers: int, batch: int) -> Case:
    """Returns the middle stage of an MLP of 3 stages of ``layers`` Dense(``width``) + tanh
    layers, with a microbatch of ``batch`` rows."""
    from models import mlp

    cfg = mlp.MLPConfig(
        in_dim=width,
        width=width,
        depth=3 * layers,
        out_dim=width,
        stage_boundaries=(layers - 1, 2 * layers - 1),
    )
    return Case(
        f"MLP middle stage ({layers} x Dense({width}), batch {batch})",
        mlp.make_loss_fn(cfg),
        mlp.init_params(jax.random.key(0), cfg),
        mlp.make_batch(jax.random.key(1), cfg, batch),
        None,
        1,
    )


def _gpt_config(sizes: Sizes) -> Any:
    """Returns the GPT of 3 stages of ``sizes.blocks_per_stage`` blocks, cut by markers."""
    from models import gpt

    b = sizes.blocks_per_stage
    return gpt.GPTConfig(
        vocab_size=sizes.gpt_vocab,
        seq_len=sizes.gpt_seq,
        d_model=sizes.gpt_width,
        num_heads=sizes.gpt_heads,
        num_layers=3 * b,
        stage_boundaries=(b - 1, 2 * b - 1),
        dtype=sizes.gpt_dtype,
    )


def _gpt_what(sizes: Sizes) -> str:
    what = (
        f"{sizes.blocks_per_stage} blocks, d {sizes.gpt_width}, seq {sizes.gpt_seq}, "
        f"batch {sizes.gpt_batch}"
    )
    return what if sizes.gpt_dtype == "float32" else f"{what}, {sizes.gpt_dtype}"


def gpt_linen_cases(sizes: Sizes) -> list[Case]:
    """Returns the linen GPT's first, middle and last stages (3 stages cut by markers)."""
    from models import gpt

    cfg = _gpt_config(sizes)
    batch = gpt.make_batch(jax.random.key(1), cfg, sizes.gpt_batch)
    params = gpt.init_params(jax.random.key(0), cfg)
    loss_fn = gpt.make_loss_fn(cfg)
    what = _gpt_what(sizes)
    return [
        Case(
            f"GPT linen {where} ({extra}{what}{' + head' if index == 2 else ''})",
            loss_fn,
            params,
            batch,
            None,
            index,
        )
        for index, where, extra in (
            (0, "first", "embedding + "),
            (1, "middle", ""),
            (2, "last", ""),
        )
    ]


def reference_cases(sizes: Sizes) -> list[Case]:
    """Returns the stages to time: MLP middle, GPT first/middle/last, scanned GPT middle."""
    from models import gpt, gpt_scan

    scan_cfg = replace(_gpt_config(sizes), stage_boundaries=())
    scanned = Case(
        f"GPT nn.scan middle (auto cut, {_gpt_what(sizes)})",
        gpt_scan.make_loss_fn(scan_cfg),
        gpt_scan.init_params(jax.random.key(0), scan_cfg),
        gpt.make_batch(jax.random.key(1), scan_cfg, sizes.gpt_batch),
        3,
        1,
    )
    mlp = mlp_case(sizes.mlp_width, sizes.mlp_layers_per_stage, sizes.mlp_batch)
    return [mlp, *gpt_linen_cases(sizes), scanned]


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


@dataclass
class Prepared:
    """A reference stage's B, W and BW, looped as the pipeline's tick loop runs them, with the
    arguments that time them."""

    program: Any  # zbjax.stages.StageProgram
    backward_input: Any  # zbjax.profile.Looped
    backward_weight: Any
    backward: Any
    args: list  # B's and BW's arguments
    residuals: list  # the residuals among them (W's first argument)
    new: Any  # the stash values B wrote for W (W's second argument)
    unmerged: Any = None  # BW as JAX traced it (contracting dims not merged, scans looped)


def prepare(case: Case, unmerged: bool = False) -> Prepared:
    """Returns ``case``'s stage split into B and W, each looped, and their arguments; with
    ``unmerged``, also its BW as JAX traced it (dots unmerged, scans not unrolled)."""
    graph = partition(case.loss_fn, case.params, case.microbatch, num_stages=case.num_stages)
    programs = split(graph)
    program = programs[case.stage_index]
    as_traced = None
    if unmerged:
        plain = split_stage(graph.stages[case.stage_index], merge_contracting=False, unroll_scans=0)
        assert plain.backward.in_avals == program.backward.in_avals
        as_traced = looped(jaxpr_as_fun(plain.backward))
    args = stage_arguments(
        graph,
        programs,
        jax.tree_util.tree_leaves(case.params),
        jax.tree_util.tree_leaves(case.microbatch),
        case.stage_index,
    )[1]
    num_in = sum(graph.stages[case.stage_index].input_differentiable)
    plain_b, plain_w = lowered_b_and_w(program, num_in)
    # Each timed call runs its program LOOP_RUNS times in a loop writing its outputs into slot
    # pools it keeps, as the pipeline's tick loop does (``zbjax.profile.looped``); times are
    # per run.
    backward_input = looped(plain_b)
    # W reads what B wrote for it; taken once (the pools B's calls return are reused).
    new = backward_input.outputs(backward_input(*args))[1]
    return Prepared(
        program,
        backward_input,
        looped(plain_w, apart=weight_apart(args)),
        looped(jaxpr_as_fun(program.backward)),
        args,
        args[: len(program.residual_avals)],
        new,
        as_traced,
    )


def measure(
    case: Case, repeats: int, chain: int = 1, unmerged: bool = False, copies: bool = False
) -> Measurement:
    """Returns the timing of B-then-W against BW for ``case``, alternating, median of pairs
    (``chain``: see ``measure_prepared``; ``unmerged``: also time BW as JAX traced it;
    ``copies``: also time one copy of B's new stash, ``copy_seconds``)."""
    return measure_prepared(case.label, prepare(case, unmerged), repeats, chain, copies)


def measure_prepared(
    label: str, p: Prepared, repeats: int, chain: int = 1, copies: bool = False
) -> Measurement:
    """Returns the timing of B-then-W against BW of a prepared stage, alternating, median of
    pairs (``copies``: also time one copy of B's new stash, ``copy_seconds``).

    With ``chain`` 1, each timed call waits for the device: W starts after B is done, as on a
    CPU, where two programs in flight at once would share the cores. With ``chain`` > 1 (for
    a GPU, whose stream runs programs in order), each sample queues ``chain`` calls and waits
    once, so that the host's dispatch of the next call overlaps the device's work, as inside
    one compiled pipeline step; waiting after each call would leave the device idle for the
    host's round trip, twice per pair for the split and once for BW.
    """
    if chain < 1:
        raise ValueError(f"chain={chain}; it must be at least 1")
    program, args, residuals, new = p.program, p.args, p.residuals, p.new
    backward_input, backward_weight, backward = p.backward_input, p.backward_weight, p.backward
    forwarded = stash_forwarded(program)
    runs = chain * LOOP_RUNS

    def queue(*calls: Callable[[], Any]) -> float:
        """Returns the seconds per run of ``chain`` rounds of ``calls``, waiting at the end
        (after each call when ``chain`` is 1)."""
        began = time.perf_counter()
        for _ in range(chain):
            for call in calls:
                out = call()
                if chain == 1:
                    _block(out)
        _block(out)
        return (time.perf_counter() - began) / runs

    def b() -> Any:
        return backward_input(*args)

    def w() -> Any:
        return backward_weight(residuals, new)

    def bw() -> Any:
        return backward(*args)

    def as_traced() -> Any:
        return p.unmerged(*args)

    for _ in range(3):  # compile and warm up all three (four)
        queue(b, w)
        queue(bw)
        if p.unmerged is not None:
            queue(as_traced)
    # B, then W, each waited for, tell how the time divides (timed apart from the pairs).
    b_times, w_times = [], []
    for _ in range(repeats):
        b_times.append(queue(b))
        w_times.append(queue(w))
    split_times, fused_times, unmerged_times = [], [], []
    for r in range(repeats):
        # Alternate which variant goes first so that drift in machine load hits both alike.
        if r % 2 == 0:
            split_times.append(queue(b, w))
            fused_times.append(queue(bw))
        else:
            fused_times.append(queue(bw))
            split_times.append(queue(b, w))
        if p.unmerged is not None:
            unmerged_times.append(queue(as_traced))
    ratios = [s / f for s, f in zip(split_times, fused_times, strict=True)]
    merge_ratios = [
        f / u for f, u in zip(fused_times[: len(unmerged_times)], unmerged_times, strict=True)
    ]
    return Measurement(
        label,
        statistics.median(split_times),
        statistics.median(fused_times),
        statistics.median(b_times),
        statistics.median(w_times),
        statistics.median(ratios),
        matmul_flops(program.backward_input),
        matmul_flops(program.backward_weight),
        matmul_flops(program.backward),
        program.stash_bytes,
        program.activation_bytes,
        sum(
            aval.size * aval.dtype.itemsize
            for aval, f in zip(program.stash_avals, forwarded, strict=True)
            if f is None
        ),
        repeats,
        statistics.median(unmerged_times) if unmerged_times else None,
        statistics.median(merge_ratios) if merge_ratios else None,
        copy_seconds(p, repeats) if copies else None,
    )


def copy_seconds(p: Prepared, repeats: int) -> float:
    """Returns the median seconds per run of copying the stash values B wrote for W into a
    pool slot, looped as the pipeline runs an action: one read and one write of each, what
    B's write of them into its slot and W's read of them out of one each cost."""
    new = list(p.new)
    if not jax.tree_util.tree_leaves(new):
        return 0.0  # B writes nothing for W
    copy = looped(lambda *values: values)
    for _ in range(3):
        _block(copy(*new))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        _block(copy(*new))
        times.append((time.perf_counter() - began) / copy.runs)
    return statistics.median(times)


def width_cases(widths: Sequence[int], sizes: Sizes) -> list[Case]:
    """Returns the MLP stage at each of ``widths`` (``sizes``' layers per stage and batch)."""
    return [mlp_case(w, sizes.mlp_layers_per_stage, sizes.mlp_batch) for w in widths]


def width_table(widths: Sequence[int], measurements: Sequence[Measurement]) -> str:
    """Returns the markdown table of the MLP stage across ``widths`` (one measurement each,
    with its stash copy timed)."""
    rows = [
        "| width | B then W (ms) | BW (ms) | ratio (median of pairs) | new MB | one copy of it "
        "(ms) | 1 + 2 copies / BW | BW GFLOP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for width, m in zip(widths, measurements, strict=True):
        rows.append(
            f"| {width} | {m.split_s * 1e3:.2f} | {m.fused_s * 1e3:.2f} | {m.ratio:.3f} | "
            f"{m.new_stash_bytes / 1e6:.2f} | {_ms(m.copy_s, 3)} | {_num(m.copies_ratio)} | "
            f"{m.flops_bw / 1e9:.3f} |"
        )
    return "\n".join(rows)


def widths_verdict(widths: Sequence[int], measurements: Sequence[Measurement]) -> str:
    """Returns the sentence that says from which width on the ratio meets the target."""
    ratios = [m.ratio for m in measurements]
    met = [w for w, r in zip(widths, ratios, strict=True) if r <= TARGET_RATIO]
    if not met:
        where = "at none of them"
    elif all(r <= TARGET_RATIO for w, r in zip(widths, ratios, strict=True) if w >= min(met)):
        where = f"from width {min(met)} on"
    else:
        where = "at width " + ", ".join(str(w) for w in met) + " only"
    return (
        f"Ratio at widths {', '.join(str(w) for w in widths)}: "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; within the {TARGET_RATIO} target {where}."
    )


def measurements_json(measurements: Sequence[Measurement]) -> list[dict[str, Any]]:
    """Returns ``measurements`` as JSON-ready dicts (``measurements_from_json`` reads them)."""
    return [asdict(m) for m in measurements]


def measurements_from_json(data: Sequence[dict[str, Any]]) -> list[Measurement]:
    """Returns the measurements ``measurements_json`` wrote."""
    return [Measurement(**d) for d in data]


def one_core_measurements(json_flag: str, repeats: int, *args: str) -> list[Measurement]:
    """Returns what a copy of this script pinned to one core measures when run with
    ``json_flag`` (``--one-core-json``: every reference case; ``--widths-json``: the MLP
    stage at the widths in ``args``)."""
    data = run_pinned_copy(__file__, json_flag, "--repeats", str(repeats), *args)
    return measurements_from_json(data)


def _ms(seconds: float | None, digits: int = 2) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def table(
    measurements: Sequence[Measurement], one_core: Sequence[Measurement] | None = None
) -> str:
    """Returns the markdown table of measurements (``one_core``: the same cases measured on
    one core, matched by label; "–" where not measured)."""
    alone = {m.label: m for m in one_core or ()}
    rows = [
        "| stage | B then W (ms) | of which B | of which W | BW (ms) | ratio (median of pairs) "
        "| 1 + 2 copies / BW | ratio, one core | 1 + 2 copies / BW, one core | B GFLOP | "
        "W GFLOP | BW GFLOP | B + W == BW | residuals MB | stash MB | new MB | "
        "BW as traced (ms) | BW / as traced |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in measurements:
        same = "yes" if m.flops_b + m.flops_w == m.flops_bw else "NO"
        one = alone.get(m.label)
        rows.append(
            f"| {m.label} | {m.split_s * 1e3:.2f} | {m.b_s * 1e3:.2f} | {m.w_s * 1e3:.2f} | "
            f"{m.fused_s * 1e3:.2f} | {m.ratio:.3f} | {_num(m.copies_ratio)} | "
            f"{_num(one and one.ratio)} | {_num(one and one.copies_ratio)} | "
            f"{m.flops_b / 1e9:.3f} | {m.flops_w / 1e9:.3f} | {m.flops_bw / 1e9:.3f} | {same} | "
            f"{m.activation_bytes / 1e6:.1f} | {m.stash_bytes / 1e6:.1f} | "
            f"{m.new_stash_bytes / 1e6:.1f} | {_ms(m.unmerged_s)} | {_num(m.merge_ratio)} |"
        )
    return "\n".join(rows)


def measure_all(
    repeats: int,
    cases: Sequence[Case] | None = None,
    unmerged: bool = False,
    copies: bool = False,
) -> list[Measurement]:
    """Returns the measurement of every case (the reference cases by default), printing each
    as it finishes (``unmerged``, ``copies``: see ``measure``)."""
    measurements = []
    for case in reference_cases(Sizes()) if cases is None else cases:
        m = measure(case, repeats, unmerged=unmerged, copies=copies)
        print(
            f"{m.label}: split {m.split_s * 1e3:.2f} ms, fused {m.fused_s * 1e3:.2f} ms, "
            f"ratio {m.ratio:.3f}, 1 + 2 copies / BW {_num(m.copies_ratio)}",
            flush=True,
        )
        measurements.append(m)
    return measurements


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing every case and writing the "bw_split" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41, help="timed pairs per stage")
    parser.add_argument(
        "--one-core-json",
        type=Path,
        help="pin this process to one core, measure, write the measurements here as JSON and "
        "stop (how the script measures its one-core columns)",
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=list(WIDTHS),
        help="widths of the MLP stage timed on one core (default: %(default)s)",
    )
    parser.add_argument(
        "--widths-json",
        type=Path,
        help="pin this process to one core, time the MLP stage at --widths, write the "
        "measurements here as JSON and stop (how the script measures its width table)",
    )
    args = parser.parse_args(argv)
    for out, cases in (
        (args.one_core_json, lambda: None),
        (args.widths_json, lambda: width_cases(args.widths, Sizes())),
    ):
        if out is not None:
            pin_to_one_core()
            measured = measure_all(args.repeats, cases(), copies=True)
            out.write_text(json.dumps(measurements_json(measured)))
            return 0
    began = time.perf_counter()
    load_before = machine_load()
    measurements = measure_all(args.repeats, unmerged=True, copies=True)
    print("again, pinned to one core:", flush=True)
    one_core = one_core_measurements("--one-core-json", args.repeats)
    print("the MLP stage across widths, pinned to one core:", flush=True)
    widths = one_core_measurements(
        "--widths-json", args.repeats, "--widths", *(str(w) for w in args.widths)
    )
    load_after = machine_load()
    worst = max(m.ratio for m in measurements)
    worst_one = max(m.ratio for m in one_core)
    flops_equal = all(m.flops_b + m.flops_w == m.flops_bw for m in measurements)
    body = "\n".join(
        [
            "## B/W split overhead: B then W versus fused BW, per stage",
            "",
            f"Made by `{COMMAND} --repeats {args.repeats}` on CPU "
            f"({jax.devices()[0].device_kind}, {os.cpu_count()} cores, jax {jax.__version__}).",
            "Each stage's B and W are jitted separately and run back to back as the pipeline "
            "runs them: B returns the input cotangents and the stash values W needs that are "
            "not residuals; W reads those and, where F stored them, the residuals "
            "(`zbjax.split.forwarded_stash`); on CPU W reads the values B wrote inside a "
            "conditional, as the lowering does (`zbjax.lower.read_apart`, see `stash_reads`). "
            "BW is the fused backward jitted as one call. All three contract each dot over "
            "one merged dimension where JAX's contracts over several adjacent ones (the "
            "weight gradient of a Dense layer over (batch, seq): "
            "`zbjax._jax_compat.merge_contracting_dims`), and run a scan of at most "
            f"{UNROLL_SCAN_LENGTH} iterations unrolled (the `nn.scan` stage's 2 layers: "
            "`zbjax._jax_compat.unroll_short_scans`); *BW as traced* is BW as JAX traced "
            "it, dots unmerged (XLA transposes the cotangent first) and scans looped "
            "(`split_stage(merge_contracting=False, unroll_scans=0)`), timed in the same "
            "rounds; *BW / as traced* is the median over rounds of the ratio. "
            f"Each timed call runs its program {LOOP_RUNS} times in a loop that writes each "
            f"run's outputs into a slot of pools of {LOOP_SLOTS} slots kept between calls, as "
            "the pipeline's tick loop writes its arenas (`zbjax.profile.looped`): XLA "
            "computes an output into a buffer of its own and copies it into the slot, which "
            "costs the split (more outputs: B's stash) more than the fused backward; times "
            "are per run (timed one run per call, every run would write freshly allocated "
            "outputs whose pages the allocator faults in anew). W starts when B is done, as in "
            f"the pipeline. The two alternate (A B B A ...) {args.repeats} times after "
            "warm-up; times are medians, the ratio is the median over pairs of (B then W) / "
            "BW; the B and W columns come from separate runs that time B and W apart. "
            "FLOPs are matmul FLOPs counted on the jaxprs (`zbjax.cost_model.matmul_flops`); "
            "residuals MB is M_B (`activation_bytes`, kept from F to B), stash MB is M_W "
            "(`stash_bytes`, what W reads), new MB what B writes for W (the part of the stash "
            "that is not a residual). Writing those values and reading them back is work the "
            "fused BW does not do, so is running two programs instead of one: B copies each "
            "value it writes for W into a slot, and W, whose matmuls need it contiguous, "
            "copies it out of one. *1 + 2 copies / BW* is the ratio if those two copies were "
            "the split's only extra work, from the time of copying the new values into a slot "
            "once, looped the same way (`copy_seconds`). *ratio, one "
            "core* is the same measurement by a copy of the script pinned to one core "
            "(`--one-core-json`), as one pipeline device gets when devices have a core each: "
            "with both cores, XLA runs the fused backward's two independent matmul chains (input "
            "gradient and weight gradient) side by side, which B alone cannot, so the all-core "
            "ratio also measures that intra-op parallelism.",
            "",
            table(measurements, one_core),
            "",
            f"Target: ratio ≤ {TARGET_RATIO}. Worst ratio measured: {worst:.3f} on all cores, "
            f"{worst_one:.3f} on one core "
            f"({'met' if max(worst, worst_one) <= TARGET_RATIO else 'NOT met'}). "
            f"B + W FLOPs equal BW FLOPs for every stage: {'yes' if flops_equal else 'NO'}.",
            "",
            "**The MLP stage across widths**, pinned to one core (a copy of the script, "
            f"`--widths-json`; {Sizes().mlp_layers_per_stage} layers, batch "
            f"{Sizes().mlp_batch}, timed as above). The copies grow with the width, the "
            "matmuls with its square.",
            "",
            width_table(args.widths, widths),
            "",
            widths_verdict(args.widths, widths),
            "",
            f"Machine load before: `{load_before}`; after: `{load_after}` (the machine is "
            "shared, so absolute times are noisy; the alternating ratio is the number to read).",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("bw_split", body)
    print(f"wrote {path}")
    return 0 if flops_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
