"""Graph pipeline vs sequential pipeline on GraphPipe's multi-modal transformer (no JAX).

The model: 4 branches (one per modality) of an embedding and 12 transformer layers (hidden
1024, 16 heads, sequence 256), joined by a concat and a classification head, as an op graph
with analytic per-layer costs (``zbjax.graphpipe.multimodal_transformer_graph``). On 8
devices it compares the best sequential (chain) partition under 1F1B with the graph
partition found by ``graph_partition`` under dag-1f1b and dag-zb, all simulated.

Writes the section "graphpipe" of ``benchmarks/RESULTS.md`` and three Gantt charts (m = 8) to
``benchmarks/figures/``. Run: ``python benchmarks/graphpipe.py``. Exits 1 when an acceptance
check fails (graph <= 0.75 x chain at m = 8 with less activation memory; dag-zb never slower
than dag-1f1b, strictly faster when m >= 2 x depth).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from _results import write_section

from zbjax.graphpipe import (
    GraphPartition,
    chain_partition,
    graph_partition,
    multimodal_transformer_graph,
    peak_activation_bytes,
    schedule_for,
    transformer_layer_costs,
)
from zbjax.schedules import Costs, Schedule, simulate
from zbjax.schedules.dag import longest_span
from zbjax.schedules.plot import gantt

COMMAND = "python benchmarks/graphpipe.py"
FIGURES = Path(__file__).resolve().parent / "figures"
DEVICES = 8
MICROBATCHES = (4, 8, 16, 32)
FIGURE_MICROBATCHES = 8
HIDDEN, HEADS, SEQ, LAYERS, BRANCHES = 1024, 16, 256, 12, 4


@dataclass(frozen=True)
class Run:
    """Simulated step time, longest device span and peak activation bytes of one schedule."""

    schedule: Schedule
    makespan: float
    span: float
    activation_bytes: float


def run(partition: GraphPartition, m: int, kind: str, unit: float) -> Run:
    """Returns the simulated run of ``partition`` with ``kind``, times in units of ``unit``."""
    costs = partition.costs
    scaled = Costs(
        tuple(x / unit for x in costs.f),
        tuple(x / unit for x in costs.b),
        tuple(x / unit for x in costs.w),
        0.0,
    )
    options = {"costs": scaled} if kind == "dag-zb" else {}
    schedule = schedule_for(partition, m, kind, **options)
    result = simulate(schedule, scaled)
    return Run(
        schedule,
        result.makespan,
        longest_span(schedule, result),
        max(peak_activation_bytes(partition, schedule)),
    )


def main() -> int:
    """Returns 0 after writing the table and figures (1 if an acceptance check fails)."""
    began = time.perf_counter()
    graph = multimodal_transformer_graph(BRANCHES, LAYERS, HIDDEN, HEADS, SEQ)
    unit = transformer_layer_costs(HIDDEN, HEADS, SEQ)[0]  # one layer's forward
    rows = [
        "| m | chain 1F1B | graph 1F1B | graph / chain | graph ZB | ZB / 1F1B (makespan, span) "
        "| peak act. chain | peak act. graph | depth chain / graph | search |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures, stage_lines = [], []
    for m in MICROBATCHES:
        start = time.perf_counter()
        partition = graph_partition(graph, DEVICES, m)
        search = time.perf_counter() - start
        chain = chain_partition(graph, DEVICES, m)
        chain_run = run(chain, m, "dag-1f1b", unit)
        one, zb = run(partition, m, "dag-1f1b", unit), run(partition, m, "dag-zb", unit)
        ratio = one.makespan / chain_run.makespan
        depth = partition.depth()
        rows.append(
            f"| {m} | {chain_run.makespan:.1f} | {one.makespan:.1f} | {ratio:.3f} | "
            f"{zb.makespan:.1f} | {zb.makespan / one.makespan:.3f}, {zb.span / one.span:.3f} | "
            f"{chain_run.activation_bytes / 2**20:.0f} MiB | {one.activation_bytes / 2**20:.0f} MiB"
            f" | {chain.depth()} / {depth} | {search:.2f} s |"
        )
        if zb.makespan > one.makespan + 1e-9 or zb.span > one.span + 1e-9:
            failures.append(f"m={m}: dag-zb slower than dag-1f1b")
        if m >= 2 * depth and not zb.makespan < one.makespan:
            failures.append(f"m={m} >= 2 x depth {depth}: dag-zb not strictly faster")
        if m == FIGURE_MICROBATCHES:
            if ratio > 0.75:
                failures.append(f"m={m}: graph / chain = {ratio:.3f} > 0.75")
            if one.activation_bytes >= chain_run.activation_bytes:
                failures.append(f"m={m}: graph pipeline does not save activation memory")
            stage_lines = [
                f"- stage {s} on device {partition.placement[s]}: {name}"
                for s, name in enumerate(partition.stage_names)
            ]
            edges = ", ".join(f"{a}→{b}" for a, b in partition.edges)
            stage_lines.append(f"- stage DAG edges: {edges}")
            FIGURES.mkdir(parents=True, exist_ok=True)
            for name, result, title in (
                ("graph-1f1b", one, "graph pipeline, dag-1f1b"),
                ("graph-zb", zb, "graph pipeline, dag-zb"),
                ("chain-1f1b", chain_run, "sequential (chain) pipeline, 1F1B"),
            ):
                costs = (chain if name.startswith("chain") else partition).costs
                scaled = Costs(*(tuple(x / unit for x in c) for c in (costs.f, costs.b, costs.w)))
                gantt(
                    result.schedule,
                    scaled,
                    path=FIGURES / f"graphpipe-{name}.png",
                    title=f"{title} (m = {m}, {DEVICES} devices)",
                )
    elapsed = time.perf_counter() - began
    body = [
        "## GraphPipe: graph pipeline vs sequential pipeline (multi-modal transformer)",
        "",
        f"Made by `{COMMAND}` (simulator only, no JAX). Model: {BRANCHES} branches × "
        f"({LAYERS} transformer layers + embedding), hidden {HIDDEN}, {HEADS} heads, sequence "
        f"{SEQ}, joined by a concat and a classification head ({len(graph.nodes)} op nodes, "
        "analytic matmul FLOPs per layer). "
        f"{DEVICES} devices. Times are in units of one layer's forward; F, B, W per stage are "
        "the sums over its layers. *chain*: the best contiguous split of a topological order "
        "(1F1B); *graph*: `graph_partition` (series-parallel DP, refined by simulation) "
        "under dag-1f1b and dag-zb (B/W split, W in the gaps, memory limit = dag-1f1b's "
        "peak). Peak activation memory is the largest device's, per sequence of a "
        "microbatch (16-bit values, the Zero Bubble paper's per-layer estimate). *search* is "
        "the partitioner's wall time.",
        "",
        *rows,
        "",
        f"Graph partition at m = {FIGURE_MICROBATCHES}:",
        "",
        *stage_lines,
        "",
        "The graph pipeline is shallower (fewer microbatches in flight, shorter warm-up), which "
        "wins at small m; its bottleneck stage (half a branch plus the head) is slightly "
        "heavier than the chain's balanced stages, so the gain shrinks as m grows.",
        "",
        "Gantt charts (m = 8): [graph 1F1B](figures/graphpipe-graph-1f1b.png), "
        "[graph ZB](figures/graphpipe-graph-zb.png), "
        "[chain 1F1B](figures/graphpipe-chain-1f1b.png).",
        "",
        "Acceptance: " + ("all checks pass." if not failures else "; ".join(failures)),
        f"\nTook {elapsed:.1f} s.",
    ]
    path = write_section("graphpipe", "\n".join(body))
    print("\n".join(rows))
    print(f"wrote {path} and 3 figures in {FIGURES} ({elapsed:.1f} s)")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
