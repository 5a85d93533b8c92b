"""Does splitting B and W cost time inside the compiled step? One device, split against fused.

``bw_split`` times each stage's B, W and fused BW alone, each in a loop that stands for the
tick loop. This script measures the split where it runs: in the pipeline's compiled step. Each
reference model (the MLP, the GPT, the scanned GPT) is cut into 3 stages and pipelined on ONE
device three ways: with every stage's backward fused; split by ``dag-zb`` over the chain of
stages (per microbatch F F F, then B and W of each stage from the last, each W right after
its B); and split with each microbatch's W deferred past the next microbatch's forwards, as a
zero-bubble schedule defers W (its stash leaves the cache before W reads it back). The fused
schedule is ``dag-zb``'s with each B turned into a BW where it stands and its W dropped
(``zbjax.ticks.fuse_backward``). On one device nothing waits for another, so the steps differ
only in the split and where W runs. They alternate round by round; per model and split
variant the table gives both steps, their ratio, the extra time per microbatch, and that
extra over the backward's own time in the step (the stages' BW as a trace of the fused step
times them, ``pipe.profile``): the whole backward's split overhead. Traces of every step also
give each stage's B + W over its BW as they ran. Pinned to one core, the share of a pipeline
device when devices have a core each (on CPU; a GPU is one device anyway).
Writes the section "bw_in_step" of ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/bw_in_step.py [--rounds N] [--seconds S] [--profiles N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bw_split
from _results import machine_load, pin_to_one_core, write_section
from step_time import alternate, median_ratio, ratio_quartiles

import zbjax
from zbjax import schedules
from zbjax.errors import PipelineError
from zbjax.ticks import fuse_backward
from zbjax.trace import ActionTimes

COMMAND = "python benchmarks/bw_in_step.py"
NUM_STAGES = 3
MICROBATCHES = 4
#: The most rounds ``measure`` runs to fill its time.
MAX_ROUNDS = 101
FUSED = "backward fused"
#: The split variants: W right after its B, and W deferred past the next microbatch's forwards.
SPLIT, DEFERRED = "W right after its B", "W after the next forwards"


@dataclass(frozen=True)
class Model:
    """A reference model cut into ``NUM_STAGES`` stages, with one microbatch."""

    label: str
    loss_fn: Callable[..., Any]
    params: Any
    microbatch: Any
    num_stages: int | None  # given to the pipeline; None where markers cut the model


def reference_models(sizes: bw_split.Sizes) -> list[Model]:
    """Returns the MLP, the GPT and the scanned GPT of ``bw_split.reference_cases`` (the
    cases time one stage of each; here all 3 stages run)."""
    cases = bw_split.reference_cases(sizes)
    mlp_case, gpt_case, scan_case = cases[0], cases[1], cases[-1]
    gpt = (
        f"{sizes.blocks_per_stage} blocks, d {sizes.gpt_width}, seq {sizes.gpt_seq}, "
        f"batch {sizes.gpt_batch}"
    )
    labels = (
        f"MLP (3 stages of {sizes.mlp_layers_per_stage} x Dense({sizes.mlp_width}), "
        f"batch {sizes.mlp_batch})",
        f"GPT linen (3 stages of {gpt})",
        f"GPT nn.scan (auto cut into 3 stages of {gpt})",
    )
    return [
        Model(label, case.loss_fn, case.params, case.microbatch, case.num_stages)
        for label, case in zip(labels, (mlp_case, gpt_case, scan_case), strict=True)
    ]


@dataclass(frozen=True)
class Result:
    """One model's step times per variant (seconds per round) and its profiles."""

    label: str
    times: dict[str, list[float]]
    profiles: dict[str, list[ActionTimes]]

    @property
    def rounds(self) -> int:
        """Returns how many rounds timed the steps."""
        return len(self.times[FUSED])

    def stage_seconds(self, variant: str, kind: str, stage: int) -> float | None:
        """Returns the median over profiles of one run of ``kind`` of ``stage``, or None where
        the traces show no such action (a GPU with command buffers on hides them)."""
        try:
            runs = [p.per_run(f"{kind} s{stage}") for p in self.profiles[variant]]
        except PipelineError:
            return None
        return statistics.median(runs)

    def stage_parts(self, variant: str, stage: int) -> tuple[float, float, float] | None:
        """Returns the traces' B and W of ``stage`` in split ``variant``'s step and its BW in
        the fused step, or None where the traces lack one."""
        b, w = (self.stage_seconds(variant, k, stage) for k in ("B", "W"))
        bw = self.stage_seconds(FUSED, "BW", stage)
        return None if b is None or w is None or bw is None else (b, w, bw)

    def stage_ratio(self, variant: str, stage: int) -> float | None:
        """Returns (B + W) / BW of ``stage`` in the step of split ``variant``, from the
        traces."""
        parts = self.stage_parts(variant, stage)
        return None if parts is None else (parts[0] + parts[1]) / parts[2]

    def backward_seconds(self) -> float | None:
        """Returns the fused backward's time per microbatch in the step: the stages' BW."""
        bws = [self.stage_seconds(FUSED, "BW", s) for s in range(NUM_STAGES)]
        return None if None in bws else sum(bws)

    def extra_seconds(self, variant: str) -> float:
        """Returns split ``variant``'s extra time per microbatch: the median over rounds of
        (split − fused) in the same round, over m."""
        pairs = zip(self.times[variant], self.times[FUSED], strict=True)
        return statistics.median(a - b for a, b in pairs) / MICROBATCHES

    def traced_extra_seconds(self, variant: str) -> float | None:
        """Returns split ``variant``'s extra time per microbatch as the traces time the
        actions: the stages' B + W − BW."""
        stages = [self.stage_parts(variant, s) for s in range(NUM_STAGES)]
        if any(parts is None for parts in stages):
            return None
        return sum(b + w - bw for b, w, bw in stages)

    def backward_ratio(self, variant: str) -> float | None:
        """Returns the backward's split overhead in the step of split ``variant``: 1 + extra
        / backward."""
        backward = self.backward_seconds()
        return None if backward is None else 1.0 + self.extra_seconds(variant) / backward


def variants() -> dict[str, schedules.Schedule]:
    """Returns the three schedules on one device: every backward fused; dag-zb over the chain
    of stages (per microbatch F F F, then B and W of each stage from the last, W right after
    its B); and the same with each microbatch's W run after the next microbatch's forwards,
    as a zero-bubble schedule defers W (the last microbatch's at the end)."""
    split = schedules.build(
        "dag-zb",
        num_stages=NUM_STAGES,
        num_microbatches=MICROBATCHES,
        num_devices=1,
        edges=[(s, s + 1) for s in range(NUM_STAGES - 1)],
        placement=(0,) * NUM_STAGES,
    )

    def of(kind: str, microbatch: int) -> list:
        return [a for a in split.actions[0] if a.kind == kind and a.microbatch == microbatch]

    deferred = []
    for i in range(MICROBATCHES):
        deferred += of("F", i) + (of("W", i - 1) if i else []) + of("B", i)
    deferred += of("W", MICROBATCHES - 1)
    return {
        FUSED: fuse_backward(split, range(NUM_STAGES)),
        SPLIT: split,
        # Deferring W holds more than dag-zb's memory limit allows: the limit goes with it.
        DEFERRED: dataclasses.replace(split.with_actions([deferred]), mem_limit=None),
    }


def measure(
    model: Model, rounds: int, profiles: int, steps: int = 3, seconds: float = 0.0
) -> Result:
    """Returns ``model``'s steps, every variant timed over ``rounds`` alternating rounds on
    the first device (more where they fit in about ``seconds``, up to ``MAX_ROUNDS``: a cheap
    model's steps differ by little, and more rounds narrow the median), and ``profiles``
    profiles of each (``steps`` traced steps each)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("pp",))
    # m copies of the microbatch: the timing does not depend on the values.
    batch = jax.tree.map(lambda x: jnp.concatenate([x] * MICROBATCHES), model.microbatch)
    pipes = {}
    for name, schedule in variants().items():
        pipe = zbjax.pipeline(
            model.loss_fn,
            mesh=mesh,
            axis_name="pp",
            schedule=schedule,
            num_microbatches=MICROBATCHES,
            num_stages=model.num_stages,
        )
        pipes[name] = (pipe, pipe.stage(model.params, batch))
    steps_of = {
        name: (lambda pipe=pipe, staged=staged: pipe.value_and_grad(staged, batch))
        for name, (pipe, staged) in pipes.items()
    }
    fused_step = steps_of[FUSED]
    jax.block_until_ready(fused_step())  # compiles
    began = time.perf_counter()
    jax.block_until_ready(fused_step())
    per_round = len(steps_of) * (time.perf_counter() - began)
    rounds = max(rounds, min(MAX_ROUNDS, int(seconds / per_round)))
    times = alternate(steps_of, rounds)
    traced: dict[str, list[ActionTimes]] = {name: [] for name in pipes}
    for k in range(profiles):
        order = list(pipes) if k % 2 == 0 else list(pipes)[::-1]
        for name in order:
            pipe, staged = pipes[name]
            traced[name].append(pipe.profile(staged, batch, steps=steps))
    return Result(model.label, times, traced)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def _signed_ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:+.2f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def table(results: Sequence[Result]) -> str:
    """Returns the markdown table: per model and split variant the two steps, their ratio,
    the extra per microbatch, the backward's overhead, and the same from the traces."""
    lines = [
        f"| model | split | rounds | step, {FUSED} (ms) | step, split (ms) | split / fused | "
        "rounds' middle half | extra per microbatch (ms) | backward per microbatch in the "
        "step (ms) | backward split / fused | extra per microbatch, traced actions (ms) | "
        "(B + W) / BW per stage, traced |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for variant in (SPLIT, DEFERRED):
            q1, q3 = ratio_quartiles(r.times, variant, FUSED)
            stages = " / ".join(_ratio(r.stage_ratio(variant, s)) for s in range(NUM_STAGES))
            lines.append(
                f"| {r.label} | {variant} | {r.rounds} | "
                f"{statistics.median(r.times[FUSED]) * 1e3:.1f} | "
                f"{statistics.median(r.times[variant]) * 1e3:.1f} | "
                f"{median_ratio(r.times, variant, FUSED):.3f} | {q1:.3f}–{q3:.3f} | "
                f"{r.extra_seconds(variant) * 1e3:+.2f} | {_ms(r.backward_seconds())} | "
                f"{_ratio(r.backward_ratio(variant))} | "
                f"{_signed_ms(r.traced_extra_seconds(variant))} | {stages} |"
            )
    return "\n".join(lines)


def target_line(results: Sequence[Result]) -> str:
    """Returns the line that sets the backward's overhead in the step beside the target."""
    measured = [
        (f"{r.label}, {variant}", r.backward_ratio(variant))
        for r in results
        for variant in (SPLIT, DEFERRED)
    ]
    known = [(label, v) for label, v in measured if v is not None]
    if not known:
        return "The traces showed no action, so the backward's time in the step is unknown."
    label, worst = max(known, key=lambda lv: lv[1])
    verdict = "met" if worst <= bw_split.TARGET_RATIO else "NOT met"
    return (
        f"Target (benchmark 2's): ≤ {bw_split.TARGET_RATIO}. Worst backward split / fused in "
        f"the step: {worst:.3f} ({label}; {verdict})."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after measuring every reference model and writing the section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11, help="alternating timed rounds")
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="per model, more rounds while they fit in about this long",
    )
    parser.add_argument("--profiles", type=int, default=2, help="profiles of each step")
    args = parser.parse_args(argv)
    pin_to_one_core()
    began = time.perf_counter()
    load_before = machine_load()
    results = []
    for model in reference_models(bw_split.Sizes()):
        results.append(measure(model, args.rounds, args.profiles, seconds=args.seconds))
        print(table(results[-1:]), flush=True)
    body = "\n".join(
        [
            "## B/W split in the compiled step: one device, split against fused",
            "",
            f"Made by `{COMMAND} --rounds {args.rounds} --seconds {args.seconds:g} --profiles "
            f"{args.profiles}`, pinned "
            f"to one core ({jax.devices()[0].device_kind}, jax {jax.__version__}). "
            f"Each reference model is cut into {NUM_STAGES} stages and pipelined on one device "
            f"with m = {MICROBATCHES} three ways: every backward fused; every backward split "
            "into B and W by `dag-zb` over the chain of stages (per microbatch F F F, then B "
            f"and W of each stage from the last: *{SPLIT}*); and split with each microbatch's "
            f"W run after the next microbatch's forwards (*{DEFERRED}*), as zero-bubble "
            "schedules defer W. The fused schedule is `dag-zb`'s with each B turned into a BW "
            "where it stands (`zbjax.ticks.fuse_backward`), so the steps differ only in the "
            "split and where W runs. They alternate round by round after warm-up, for at "
            f"least {args.rounds} rounds and as many more as fit in about {args.seconds:g} s "
            f"(up to {MAX_ROUNDS}; the *rounds* column); "
            "steps are medians, split / fused the median over rounds of the ratio within a "
            "round (rounds' middle half: its quartiles), extra per microbatch the median of "
            "the difference over m. *Backward per microbatch in the step* is the stages' BW "
            f"as `pipe.profile` timed them in the fused step (median of {args.profiles} "
            "profiles); *backward split / fused* = 1 + extra / that: what the split adds to "
            "the backward where it runs, tick-loop work for the extra actions included. The "
            "last two columns read the same from the traces alone: the stages' B + W − BW "
            "summed, and each stage's B + W over its BW (stage 0 first; its B computes "
            "nothing). Tracing slows the ops it records, and a few traced steps time a "
            "difference of a few percent loosely: the untimed steps' difference is the number "
            "for the backward as a whole, the traces show where it goes. `bw_split` times the "
            "same stages' programs alone instead.",
            "",
            table(results),
            "",
            target_line(results),
            "",
            f"Machine load before: `{load_before}`; after: `{machine_load()}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("bw_in_step", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
