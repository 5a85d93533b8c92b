"""What does ``pipe.per_leaf`` cost next to an element-wise optimizer on the staged rows?

``optax.adamw`` on the staged rows as they are (element-wise, so exact without a mask) against
``pipe.per_leaf`` running, per device, adamw, adamw with a weight-decay mask, and lamb on the
user's tree of its leaves. For each: the time to trace and lower the jitted update, to compile
it, and one update (median over alternating rounds, ratio to adamw on the rows within each
round); beside them the pipelined step (``value_and_grad``) the update follows. Writes the
section "optimizer" of ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/optimizer.py [--rounds N]``.
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

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, write_section

from models import gpt
from zbjax.cpu import use_cpu_devices
from zbjax.demo import matrices

COMMAND = "python benchmarks/optimizer.py"
BASELINE = "adamw on the rows"


@dataclass(frozen=True)
class Case:
    """A GPT pipelined over ``devices`` pp devices, one stage each."""

    name: str
    cfg: gpt.GPTConfig
    devices: int
    batch_size: int


CASES = (
    Case(
        "demo GPT (8 blocks, d 64)",
        gpt.GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_heads=4, num_layers=8),
        8,
        32,
    ),
    Case(
        "GPT (4 blocks, d 256)",
        gpt.GPTConfig(vocab_size=256, seq_len=64, d_model=256, num_heads=4, num_layers=4),
        4,
        8,
    ),
)


def variants(pipe) -> dict[str, optax.GradientTransformation]:
    return {
        BASELINE: optax.adamw(1e-3),
        "per_leaf(adamw)": pipe.per_leaf(optax.adamw(1e-3)),
        "per_leaf(adamw, decay mask)": pipe.per_leaf(optax.adamw(1e-3, mask=matrices)),
        "per_leaf(lamb)": pipe.per_leaf(optax.lamb(1e-3)),
    }


@dataclass(frozen=True)
class Row:
    case: str
    variant: str
    lower_s: float
    compile_s: float
    update_ms: float
    ratio: float  # median over rounds of update / baseline update
    step_ms: float


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def measure(case: Case, rounds: int) -> list[Row]:
    import zbjax

    boundaries = gpt.balanced_boundaries(case.cfg, case.devices)
    cfg = dataclasses.replace(case.cfg, stage_boundaries=boundaries)
    loss_fn = gpt.make_loss_fn(cfg)
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, case.batch_size)
    mesh = jax.make_mesh((case.devices,), ("pp",), devices=jax.devices()[: case.devices])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h1", num_microbatches=4)
    staged = pipe.stage(params, batch)
    _, grads = pipe.value_and_grad(staged, batch)
    step_ms = 1e3 * statistics.median(
        _timed(lambda: pipe.value_and_grad(staged, batch)) for _ in range(max(3, rounds // 4))
    )
    compiled, built = {}, {}
    for name, tx in variants(pipe).items():
        state = tx.init(staged)
        update = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))
        start = time.perf_counter()
        lowered = update.lower(grads, state, staged)
        mid = time.perf_counter()
        fn = lowered.compile()
        built[name] = (mid - start, time.perf_counter() - mid)
        compiled[name] = (fn, state)
        jax.block_until_ready(fn(grads, state, staged))
    times: dict[str, list[float]] = {name: [] for name in compiled}
    names = list(compiled)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, state = compiled[name]
            times[name].append(_timed(lambda fn=fn, state=state: fn(grads, state, staged)))
    base = times[BASELINE]
    return [
        Row(
            case.name,
            name,
            *built[name],
            1e3 * statistics.median(t),
            statistics.median(a / b for a, b in zip(t, base, strict=True)),
            step_ms,
        )
        for name, t in times.items()
    ]


def section(rows: Sequence[Row], rounds: int, load: tuple[str, str], seconds: float) -> str:
    lines = [
        "## Optimizers on staged params: per_leaf against adamw on the rows",
        "",
        f"Made by `{COMMAND} --rounds {rounds}` (jax {jax.__version__}, fake CPU devices, "
        f"{os.cpu_count()} cores). `optax.adamw` on the staged rows as they are (exact: it is "
        "element-wise) against `pipe.per_leaf(tx)`, which runs `tx` on each device's leaves "
        "in the user's tree structure (needed for a mask, labels or a per-leaf norm): unpacks "
        "its rows, runs `tx`, packs updates and state back, one `lax.switch` branch per device. "
        "*trace + lower* and *compile* are the jitted update's; *update* is the median over "
        f"{rounds} alternating rounds, *ratio* the median over rounds of it over adamw on the "
        "rows in the same round; *step* is the pipelined `value_and_grad` (zb-h1, m = 4) the "
        "update follows, for scale.",
        "",
        "| model | optimizer | trace + lower (s) | compile (s) | update (ms) | ratio | step (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.variant} | {r.lower_s:.2f} | {r.compile_s:.2f} | "
            f"{r.update_ms:.2f} | {r.ratio:.2f} | {r.step_ms:.1f} |"
        )
    worst = max((r for r in rows if r.variant != BASELINE), key=lambda r: r.ratio)
    lines += [
        "",
        f"Slowest per_leaf update: {worst.ratio:.2f}× adamw on the rows ({worst.variant}, "
        f"{worst.case}), {100 * worst.update_ms / worst.step_ms:.1f} % of its step.",
        "",
        f"Machine load before: `{load[0]}`; after: `{load[1]}`. Took {seconds:.0f} s.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="alternating rounds (default 21)")
    args = parser.parse_args(argv)
    use_cpu_devices(max(c.devices for c in CASES))
    start, before = time.perf_counter(), machine_load()
    rows = [row for case in CASES for row in measure(case, args.rounds)]
    text = section(rows, args.rounds, (before, machine_load()), time.perf_counter() - start)
    print(text)
    write_section("optimizer", text)


if __name__ == "__main__":
    main()
