"""A sequential reference executor: runs a schedule's F/B/W/BW actions one by one on one device.

``run_schedule`` is the semantics the lowered pipeline must reproduce, written as plainly as
possible: devices are visited round-robin and each runs its next action as soon as the data it
needs exists (like ``zbjax.schedules.simulate``). Activations, residuals, cotangents and W's
stash live in dictionaries keyed by (stage, microbatch) and are dropped once consumed; weight
gradients are accumulated into one running sum per param leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from zbjax.errors import PipelineError, ScheduleError
from zbjax.microbatch import microbatch_keys, split_microbatches
from zbjax.params import wide_dtype
from zbjax.schedules.ir import Action, Schedule
from zbjax.stages import StageGraph, StageProgram


def run_schedule(
    graph: StageGraph,
    programs: Sequence[StageProgram],
    schedule: Schedule,
    params: Any,
    batch: Any,
    key: jax.Array | None = None,
    *,
    jit: bool = True,
) -> tuple[jax.Array, Any]:
    """Returns (loss, grads): mean loss over microbatches and grads in ``params``' structure
    (``((loss, aux), grads)`` when the graph has ``aux_treedef``, aux averaged the same way,
    per-example rows joined: ``StageGraph.aux_rows``).

    ``batch`` is the full batch; every leaf is split along axis 0 into
    ``schedule.num_microbatches`` microbatches. When the graph was partitioned with a ``key``,
    pass ``key`` here: microbatch ``i`` gets ``jax.random.fold_in(key, i)``. Each loss-stage
    backward is seeded with 1 / num_microbatches. Raises ``ScheduleError`` when the schedule
    deadlocks or leaves work undone, ``PipelineError`` when params or batch do not fit the graph.
    """
    _check_inputs(graph, programs, schedule)
    if not isinstance(jit, bool):
        raise PipelineError(f"run_schedule's jit={jit!r}; pass True or False")
    m = schedule.num_microbatches
    param_leaves, treedef = jax.tree_util.tree_flatten(params)
    if treedef != graph.params_treedef:
        raise PipelineError(
            f"params have tree structure {treedef} but the graph was partitioned with "
            f"{graph.params_treedef}; pass the same params pytree the graph was built from"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    for path, leaf, aval in zip(paths, param_leaves, graph.param_avals, strict=True):
        shape, dtype = jax.numpy.shape(leaf), jax.numpy.result_type(leaf)
        if shape != tuple(aval.shape) or dtype != aval.dtype:
            raise PipelineError(
                f"params leaf {path or '(the params)'} is {dtype}{list(shape)} but the graph "
                f"was partitioned with {aval.dtype}{list(aval.shape)}; pass params of the "
                "shapes and dtypes the graph was built from"
            )
    batch_leaves = _microbatch_leaves(graph, batch, key, m)
    runner = _Runner(graph, programs, param_leaves, batch_leaves, m, jit)
    runner.run(schedule)
    narrowed = [g.astype(a.dtype) for g, a in zip(runner.grads, graph.param_avals, strict=True)]
    grads = jax.tree_util.tree_unflatten(graph.params_treedef, narrowed)
    return graph.loss_and_aux(runner.outputs()), grads


def _check_inputs(graph: StageGraph, programs: Sequence[StageProgram], schedule: Schedule) -> None:
    for label, value, kind, fix in (
        ("graph", graph, StageGraph, "zbjax.partition(loss_fn, params, batch)"),
        ("schedule", schedule, Schedule, "zbjax.schedules.build(name, num_stages, m)"),
    ):
        if not isinstance(value, kind):
            raise PipelineError(
                f"run_schedule's {label} is a {type(value).__name__}, not a {kind.__name__}; "
                f"pass {fix}"
            )
    if len(programs) != graph.num_stages:
        raise PipelineError(
            f"got {len(programs)} stage programs for a graph of {graph.num_stages} stages; "
            "pass split(graph)"
        )
    if schedule.num_stages != graph.num_stages:
        raise PipelineError(
            f"the schedule has {schedule.num_stages} stages but the graph has "
            f"{graph.num_stages}; build the schedule with num_stages={graph.num_stages}"
        )


def _microbatch_leaves(graph: StageGraph, batch: Any, key: Any, m: int) -> list[Any]:
    """Returns the graph's flat batch leaves, each stacked [m, ...] over microbatches."""
    stacked = split_microbatches(batch, m)
    if key is not None:
        stacked = (stacked, microbatch_keys(key, m))
    leaves, treedef = jax.tree_util.tree_flatten(stacked)
    if treedef != graph.batch_treedef:
        hint = (
            "the graph was partitioned with a key: pass key=..."
            if key is None and treedef.num_leaves + 1 == len(graph.batch_avals)
            else "pass the batch (and key, if the graph was partitioned with one) the graph "
            "was built from"
        )
        raise PipelineError(
            f"batch (with key: {key is not None}) has tree structure {treedef} but the graph "
            f"expects {graph.batch_treedef}; {hint}"
        )
    for n, (leaf, aval) in enumerate(zip(leaves, graph.batch_avals, strict=True)):
        if tuple(leaf.shape[1:]) != tuple(aval.shape):
            raise PipelineError(
                f"batch leaf {n} splits into microbatches of shape {tuple(leaf.shape[1:])} but "
                f"the graph was partitioned for {tuple(aval.shape)}; partition with one "
                f"microbatch of this batch (batch size / num_microbatches={m} rows)"
            )
    return leaves


# Jitted programs by jaxpr identity (the jaxpr is kept alive with its function), so running
# the same programs again, e.g. under another schedule, compiles nothing new.
_JITTED: dict[int, tuple[Any, Callable[..., Any]]] = {}


def _as_callable(closed: Any, jit: bool) -> Callable[..., Any]:
    if not jit:
        return jaxpr_as_fun(closed)
    if id(closed) not in _JITTED:
        if len(_JITTED) >= 512:
            _JITTED.pop(next(iter(_JITTED)))
        _JITTED[id(closed)] = (closed, jax.jit(jaxpr_as_fun(closed)))
    return _JITTED[id(closed)][1]


class _Runner:
    """The state of one sequential run: buffers keyed by (stage, microbatch), grad sums."""

    def __init__(
        self,
        graph: StageGraph,
        programs: Sequence[StageProgram],
        param_leaves: list[Any],
        batch_leaves: list[Any],
        m: int,
        jit: bool,
    ) -> None:
        self.graph = graph
        self.programs = programs
        self.params = param_leaves
        self.batch = batch_leaves
        self.m = m
        self.fns = [
            {
                "F": _as_callable(p.forward, jit),
                "B": _as_callable(p.backward_input, jit),
                "W": _as_callable(p.backward_weight, jit),
                "BW": _as_callable(p.backward, jit),
            }
            for p in programs
        ]
        # (edge, microbatch) -> values sent; (edge, microbatch) -> cotangents sent back.
        self.sent: dict[tuple[int, int], list[Any]] = {}
        self.cotangents: dict[tuple[int, int], list[Any]] = {}
        self.residuals: dict[tuple[int, int], list[Any]] = {}
        self.stash: dict[tuple[int, int], list[Any]] = {}
        self.done: set[Action] = set()
        # Summed in float32 for 16-bit floats, as the pipeline sums them (cast at the end).
        self.grads = [jnp.zeros(a.shape, wide_dtype(a.dtype)) for a in graph.param_avals]
        # The loss stage's outputs, averaged over microbatches: the loss (in float32), its aux.
        aux_avals = graph.stages[graph.loss_stage].jaxpr.out_avals[1:]
        self.totals = [jnp.zeros((), jnp.float32)] + [
            jnp.zeros(a.shape, a.dtype) for a in aux_avals
        ]
        # Aux leaves of per-example rows (``StageGraph.aux_rows``): each microbatch's, joined.
        self.rows = graph.output_rows()
        self.row_parts: list[dict[int, Any]] = [{} for _ in self.rows]

    def outputs(self) -> list[Any]:
        """Returns the loss stage's outputs over the microbatches: means, rows joined."""
        return [
            jnp.concatenate([parts[i] for i in sorted(parts)]) if joined else total
            for total, joined, parts in zip(self.totals, self.rows, self.row_parts, strict=True)
        ]

    def run(self, schedule: Schedule) -> None:
        cursor = [0] * schedule.num_devices
        remaining = sum(len(p) for p in schedule.actions)
        while remaining:
            progressed = False
            for device, program in enumerate(schedule.actions):
                while cursor[device] < len(program) and self._ready(program[cursor[device]]):
                    self._execute(program[cursor[device]])
                    cursor[device] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                waiting = "; ".join(
                    f"device {d} waits at {program[cursor[d]]}"
                    for d, program in enumerate(schedule.actions)
                    if cursor[d] < len(program)
                )
                raise ScheduleError(
                    f"deadlock: no device can run its next action ({waiting}); reorder the "
                    "actions so that each one's inputs are produced first"
                )
        self._check_complete()

    def _ready(self, action: Action) -> bool:
        s, i = action.stage, action.microbatch
        if not 0 <= s < self.graph.num_stages or not 0 <= i < self.m:
            raise ScheduleError(
                f"action {action} names stage {s} / microbatch {i}, outside the graph's "
                f"{self.graph.num_stages} stages and {self.m} microbatches"
            )
        stage = self.graph.stages[s]
        if action in self.done:
            raise ScheduleError(f"action {action} appears twice; run each action once")
        if action.kind == "F":
            return all((e, i) in self.sent for e in stage.in_edges)
        if action.kind == "W":
            return (s, i) in self.stash
        return (s, i) in self.residuals and all((e, i) in self.cotangents for e in stage.out_edges)

    def _execute(self, action: Action) -> None:
        s, i = action.stage, action.microbatch
        stage = self.graph.stages[s]
        fns = self.fns[s]
        if action.kind == "F":
            args = (
                stage.param_inputs(self.params)
                + [self.batch[leaf][i] for leaf in stage.batch_leaves]
                + [v for e in stage.in_edges for v in self.sent.pop((e, i))]
            )
            outs = list(fns["F"](*args))
            num_out = len(stage.output_differentiable)
            if s == self.graph.loss_stage:
                self.totals = [
                    t if joined else t + jnp.asarray(o).astype(t.dtype) / self.m
                    for t, o, joined in zip(self.totals, outs[:num_out], self.rows, strict=True)
                ]
                for j, joined in enumerate(self.rows):
                    if joined:
                        self.row_parts[j][i] = outs[j]
            for e, values in self._by_edge(stage.out_edges, outs[:num_out]):
                self.sent[(e, i)] = values
            self.residuals[(s, i)] = outs[num_out:]
        elif action.kind in ("B", "BW"):
            residuals = self.residuals.pop((s, i))
            outs = list(fns[action.kind](*residuals, *self._output_cotangents(stage, i)))
            num_in = sum(stage.input_differentiable)
            self._send_back(stage, i, outs[:num_in])
            if action.kind == "B":
                self.stash[(s, i)] = outs[num_in:]
            else:
                self._accumulate(stage, outs[num_in:])
        else:
            self._accumulate(stage, list(fns["W"](*self.stash.pop((s, i)))))
        self.done.add(action)

    def _by_edge(self, edges: Sequence[int], flat: Sequence[Any]) -> list[tuple[int, list[Any]]]:
        grouped, start = [], 0
        for e in edges:
            n = len(self.graph.edges[e].values)
            grouped.append((e, list(flat[start : start + n])))
            start += n
        return grouped

    def _output_cotangents(self, stage: Any, i: int) -> list[Any]:
        if stage.index == self.graph.loss_stage:
            loss_aval = stage.jaxpr.out_avals[0]
            return [jnp.asarray(1.0 / self.m, loss_aval.dtype)]
        cts = []
        for e in stage.out_edges:
            cts.extend(self.cotangents.pop((e, i)))
        return cts

    def _send_back(self, stage: Any, i: int, input_cts: list[Any]) -> None:
        """Stores the input cotangents of each in-edge, for the source stage's backward."""
        flags = iter(stage.input_differentiable)
        cts = iter(input_cts)
        for e in stage.in_edges:
            values = self.graph.edges[e].values
            # Only differentiable values have a cotangent; the producer's B expects exactly those.
            self.cotangents[(e, i)] = [next(cts) for _ in values if next(flags)]

    def _accumulate(self, stage: Any, param_cts: list[Any]) -> None:
        if len(param_cts) != len(stage.param_leaves):
            raise PipelineError(
                f"{stage.name}: W returned {len(param_cts)} param cotangents for "
                f"{len(stage.param_leaves)} param leaves; the stage program is inconsistent"
            )
        # A tied leaf read by several stages receives the sum of their contributions; a stage
        # reading some rows of a leaf adds to those rows.
        for leaf, rows, ct in zip(stage.param_leaves, stage.param_slices(), param_cts, strict=True):
            ct = ct.astype(self.grads[leaf].dtype)
            if rows is None:
                self.grads[leaf] = self.grads[leaf] + ct
            else:
                self.grads[leaf] = self.grads[leaf].at[rows[0] : rows[1]].add(ct)

    def _check_complete(self) -> None:
        missing = [
            f"{s}{kind}{i}"
            for s in range(self.graph.num_stages)
            for i in range(self.m)
            for kind in ("F", "B|BW", "W")
            if not self._has(kind, s, i)
        ]
        if missing:
            raise ScheduleError(
                f"the schedule leaves work undone: {', '.join(missing[:8])}"
                f"{' ...' if len(missing) > 8 else ''}; every (stage, microbatch) needs F, "
                "then BW, or B followed by W"
            )

    def _has(self, kind: str, s: int, i: int) -> bool:
        if kind == "F":
            return Action("F", s, i) in self.done
        if kind == "B|BW":
            return Action("B", s, i) in self.done or Action("BW", s, i) in self.done
        return Action("BW", s, i) in self.done or Action("W", s, i) in self.done
