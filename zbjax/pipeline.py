"""``zbjax.pipeline``: the public transform from a loss function to a pipelined training step.

``pipe = zbjax.pipeline(loss_fn, mesh=mesh, axis_name="pp", schedule="zb-h1",
num_microbatches=8)`` returns a ``Pipeline``. The first call with given input shapes traces
``loss_fn`` on one microbatch, partitions it into stages, splits each stage's backward into B
and W, builds the schedule and lowers everything into one jitted ``shard_map`` program; later
calls with the same shapes reuse it. ``pipe.value_and_grad(params, batch)`` equals
``jax.value_and_grad(loss_fn)(params, batch)`` (the loss is the mean over microbatches).

Choices a careful user would want to know:

- ``num_stages`` defaults to the marker count + 1 when ``loss_fn`` has ``stage_boundary``
  markers, else to the pp axis size (twice that for ``zb-v`` and ``interleaved-1f1b``).
- ``partitioner`` picks how the program is cut into stages: ``"markers"`` (at the
  ``stage_boundary`` markers; an error without any), ``"chain"`` (contiguous stages balanced
  by the cost model; an error when ``loss_fn`` has markers), ``"graph"`` (GraphPipe: the traced
  program becomes an operator graph, ``graphpipe.graph_partition`` cuts it into a DAG of at
  most one stage per pp device, independent branches in parallel stages, and its placement is
  used), or ``"auto"`` (default): markers when there are any, else ``"graph"`` for the DAG
  schedules ``dag-1f1b``/``dag-zb`` given by name (``"chain"`` where that splits a scan GraphPipe
  keeps whole into a faster plan), else ``"chain"``.
- The DAG schedules (``dag-1f1b``, ``dag-zb``) by name are built on the stage graph's edges,
  with its stage names and, unless ``costs`` is given, the stage programs' cost estimates.
  Stage ``s`` runs on device ``placement[s]``: the ``placement`` argument when given, else
  GraphPipe's placement (``partitioner="graph"``), else stage ``s`` on device ``s`` when there
  are as many stages as pp devices (otherwise it is an error that says what to pass).
- The pipeline binds to the params structure it first sees; later calls must pass params of
  the same tree and shapes, in the user layout or the staged one (``pipe.stage(params)``).
  Grads come back in the layout given. Staged params are what keep each device's parameter
  memory to its own stages; user-layout params are replicated into the program.
- Every other mesh axis is data parallel: each microbatch's rows are split evenly over those
  axes (the batch size must be a multiple of ``num_microbatches`` times their size), each
  shard runs the pipeline on its rows, and loss and grads are averaged over the shards.
- In the staged layout a tied leaf is stored once per device that reads it; clip staged grads
  with ``pipe.clip_by_global_norm`` (or measure them with ``pipe.global_norm``), which count
  every element once, not with ``optax.clip_by_global_norm``, which would count such a leaf
  twice.
- Params and batch are never donated: the step returns gradients and leaves params to the
  caller's optimizer. Only the step's own arenas are: between calls on CPU meshes
  (``keep_buffers``), and the ``Buffers`` passed as ``value_and_grad(..., buffers=)``, which
  a user's ``jax.jit`` should donate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import math
import os
import pickle
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zbjax import cost_model, graphpipe, schedules
from zbjax._jax_compat import (
    checking_numerics,
    closes_over_tracers,
    context_mesh_devices,
    exchange_between_processes,
    exchanges_made,
    in_host_memory,
    no_mesh_context,
    tracing_config,
    under_trace,
)
from zbjax.errors import PartitionError, PipelineError, ScheduleError
from zbjax.lower import Lowering, TickPlan, lower
from zbjax.markers import is_stage_boundary
from zbjax.microbatch import check_key as _check_key
from zbjax.microbatch import microbatch_keys, split_microbatches, whole_batch_aux_rows
from zbjax.optim import per_leaf
from zbjax.params import (
    StagedParams,
    dtype_name,
    stage_leaves,
    staged_sum_of_squares,
    sum_of_squares,
    unstage_leaves,
    wide_dtype,
)
from zbjax.partition import (
    caller_stacklevel,
    flat_avals,
    partition,
    stage_summary,
    warn_whole_regions,
)
from zbjax.profile import measure_exchange_costs, measure_stage_costs
from zbjax.schedules.dag import topological_order
from zbjax.schedules.ir import Costs, Schedule, integer, real_number
from zbjax.split import forwards_only, split
from zbjax.stages import StageGraph, StageProgram
from zbjax.tensor import check_row_splits, check_stage_permutes, leaf_splits, tensor_axis
from zbjax.ticks import zb_auto_in_ticks
from zbjax.trace import ActionTimes, action_times, make_output_dir

#: Schedules that put two stages on every device.
TWO_STAGES_PER_DEVICE = ("zb-v", "interleaved-1f1b")

#: How ``pipeline`` may cut the program into stages (see the module docstring).
PARTITIONERS = ("auto", "markers", "chain", "graph")


@dataclasses.dataclass(frozen=True)
class _Partitioned:
    """A stage graph and, when the partitioner chose one, the device of each stage."""

    graph: StageGraph
    placement: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class _Built:
    """One compiled variant of the step: for one set of input shapes."""

    graph: StageGraph
    programs: tuple[StageProgram, ...]
    schedule: Schedule
    lowering: Lowering
    step: Callable[..., Any]  # jitted (params or staged, batch, key) -> (loss, grads)
    partitioner: str = "chain"  # the partitioner that made ``graph`` ("auto" resolved)
    # jitted (params or staged, batch, key, Buffers) -> (loss, grads, Buffers), buffers donated
    step_with_pools: Callable[..., Any] | None = None
    # zb-auto planned with costs: each candidate order's name and its planned ticks' time
    # (``ticks.barrier_time``), the one that runs first
    in_ticks: tuple[tuple[str, float], ...] = ()
    _stage_programs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def unstage_program(self) -> Callable[[StagedParams], list[jax.Array]]:
        """Returns the jitted unstaging of rows in this build's layout, leaves replicated on
        the mesh (for rows over several processes' devices, which every process must unstage
        by the same one program)."""
        layout, mesh = self.lowering.layout, self.lowering.mesh
        return jax.jit(
            lambda staged: unstage_leaves(layout, _replicated(staged, mesh)),
            out_shardings=NamedSharding(mesh, PartitionSpec()),
        )

    def stage_program(self, rows: NamedSharding) -> Callable[[list], StagedParams]:
        """Returns the jitted staging of flat param leaves into this build's layout, rows laid
        out as ``rows`` (for leaves sharded over several devices; see ``Pipeline.stage``)."""
        if self._stage_programs.get(rows) is None:
            layout, mesh = self.lowering.layout, self.lowering.mesh
            self._stage_programs[rows] = jax.jit(
                lambda leaves: stage_leaves(layout, _replicated(leaves, mesh)), out_shardings=rows
            )
        return self._stage_programs[rows]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Buffers:
    """The arenas one pipelined step keeps its residuals and W's stash in (a pytree).

    Made by ``Pipeline.init_buffers`` for one set of input shapes; ``value_and_grad(...,
    buffers=b)`` runs the step in them instead of allocating its own and returns them, to be
    passed to the next step. Donate them to your ``jax.jit`` (``donate_argnums``) and no step
    spends time allocating and initialising them. Their contents between steps mean
    nothing.
    """

    pools: tuple[jax.Array, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the arenas hold over all devices."""
        return sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in self.pools)

    def __repr__(self) -> str:
        return f"Buffers({len(self.pools)} pools, {self.nbytes / 1e6:.1f} MB)"


def _strong(avals: Sequence[jax.ShapeDtypeStruct]) -> list[tuple]:
    """The shapes and dtypes of ``avals``, weak types left out."""
    return [(a.shape, a.dtype) for a in avals]


def _avals(tree: Any, what: str = "argument") -> Any:
    """Returns ``tree`` with each leaf's aval; raises PipelineError naming a leaf (of ``what``:
    params, batch, key) that JAX cannot take as an array (a string, an arbitrary object)."""
    avals, treedef = flat_avals(tree, what, PipelineError)
    return jax.tree_util.tree_unflatten(treedef, avals)


def _whole_number(name: str, value: Any, at_least: int = 1) -> int:
    """Returns ``value`` as an int (a Python or NumPy integer, not a bool) or raises
    PipelineError naming ``name``."""
    number = integer(value)
    if number is None or number < at_least:
        raise PipelineError(f"{name}={value!r}; it must be an int >= {at_least}")
    return number


def _flag(name: str, value: Any, allow_none: bool = False) -> Any:
    """Returns ``value`` if it is True or False (or None where allowed), else raises
    PipelineError naming ``name``: a string such as "no" would be truthy."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool | np.bool_):
        return bool(value)
    shown = "None, True or False" if allow_none else "True or False"
    raise PipelineError(f"{name}={value!r}; pass {shown}")


def _shapes_text(avals: Any) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)


def _agreeing(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a Pipeline method whose eager calls check with the other processes first
    (``_agree_on_call``): where it fails on this process before that exchange (an input it
    refuses), the others, waiting there, are told (``_post_failure``) and raise too, and
    every process's exchanges stay in step. (``stage`` checks only given a batch.)"""

    @functools.wraps(method)
    def call(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        if not self._several:
            return method(self, *args, **kwargs)
        before = exchanges_made()
        try:
            return method(self, *args, **kwargs)
        except _PeerFailed:
            raise
        except Exception as err:
            checks = method.__name__ != "stage" or _argument(method, args, kwargs, "batch")
            if checks and not _traced((args, kwargs)) and exchanges_made() == before:
                _post_failure(err)
            raise

    return call


def _argument(method: Callable[..., Any], args: tuple, kwargs: dict, name: str) -> Any:
    """Returns the value a call of ``method(self, *args, **kwargs)`` binds to ``name``."""
    import inspect

    try:
        bound = inspect.signature(method).bind_partial(None, *args, **kwargs)
    except TypeError:  # arguments the method refused before it ran
        return None
    return bound.arguments.get(name)


class Pipeline:
    """A pipelined ``value_and_grad`` of ``loss_fn`` over a mesh axis (see ``pipeline``)."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        mesh: Any,
        axis_name: str = "pp",
        schedule: str | Schedule = "zb-h1",
        num_microbatches: int = 8,
        num_stages: int | None = None,
        costs: Costs | None = None,
        mem_limit: float | None = None,
        w_mem: float | None = None,
        partitioner: str = "auto",
        placement: Sequence[int] | None = None,
        keep_buffers: bool | None = None,
        pack_ticks: bool | None = None,
        has_aux: bool = False,
        param_specs: Any = None,
    ):
        if not callable(loss_fn):
            raise PipelineError(
                f"loss_fn is a {type(loss_fn).__name__}, not a function; pass the function "
                "loss_fn(params, batch) -> scalar loss as zbjax.pipeline's first argument"
            )
        if not isinstance(mesh, jax.sharding.Mesh):
            raise PipelineError(
                f"mesh= is a {type(mesh).__name__}, not a jax.sharding.Mesh; build one whose "
                f"axes name the pipeline axis, e.g. jax.make_mesh((num_devices,), "
                f"({axis_name!r},))"
            )
        if not isinstance(axis_name, str):
            raise PipelineError(
                f"axis_name={axis_name!r}; pass the name (a str) of the mesh axis to pipeline "
                f"over, one of {tuple(mesh.axis_names)}"
            )
        if axis_name not in mesh.axis_names:
            raise PipelineError(
                f"mesh has axes {tuple(mesh.axis_names)} but no axis named {axis_name!r}; "
                f"pass axis_name= one of {tuple(mesh.axis_names)} or build the mesh with a "
                f"{axis_name!r} axis"
            )
        num_microbatches = _whole_number("num_microbatches", num_microbatches)
        if num_stages is not None:
            num_stages = _whole_number("num_stages", num_stages)
        names = schedules.SCHEDULE_NAMES + schedules.DAG_SCHEDULE_NAMES
        if not isinstance(schedule, str | Schedule) or (
            isinstance(schedule, str) and schedule not in names
        ):
            raise ScheduleError(
                f"unknown schedule {schedule!r}; choose one of: "
                f"{', '.join(names)} or pass a zbjax.schedules.Schedule"
            )
        if isinstance(schedule, Schedule):
            given = [
                f"{label}={value!r}"
                for label, value in (("mem_limit", mem_limit), ("w_mem", w_mem))
                if value is not None
            ]
            if given:
                raise ScheduleError(
                    f"{' and '.join(given)} would build a named schedule, but schedule= is a "
                    "prebuilt Schedule, which carries its own (Schedule.mem_limit, "
                    "Schedule.w_mem); pass them to zbjax.schedules.build(...) instead"
                )
            try:
                # Every action once, in an order that runs. Not its memory limit: a planning
                # bound (zb-auto records 2 x stages when given none) that the step does not
                # enforce, and a hand-edited order may pass it and still run right.
                schedules.validate(dataclasses.replace(schedule, mem_limit=None))
            except ScheduleError as error:
                raise ScheduleError(
                    f"schedule= is a Schedule that does not run as given: {error}"
                ) from None
        costs, mem_limit, w_mem = schedules.check_options(costs, mem_limit, w_mem)
        if partitioner not in PARTITIONERS:
            raise PipelineError(
                f"unknown partitioner {partitioner!r}; choose one of {', '.join(PARTITIONERS)}"
            )
        if partitioner == "graph" and num_stages is not None:
            raise PipelineError(
                f"partitioner='graph' chooses the stage count itself (at most one stage per "
                f"device), but num_stages={num_stages} was given; leave num_stages=None, or "
                "use partitioner='chain' for a fixed count"
            )
        if placement is not None and (
            isinstance(placement, str | bytes | dict) or np.ndim(placement) != 1
        ):
            raise PipelineError(
                f"placement={placement!r}; pass the device of each stage, e.g. (0, 1, 1)"
            )
        if placement is not None and schedule not in schedules.DAG_SCHEDULE_NAMES:
            raise PipelineError(
                f"placement={tuple(placement)} is only used by the DAG schedules "
                f"{schedules.DAG_SCHEDULE_NAMES} given by name, not by "
                f"{self._name_of(schedule)!r}; "
                "leave placement=None (a prebuilt Schedule carries its own placement)"
            )
        self.loss_fn = loss_fn
        self.has_aux = _flag("has_aux", has_aux)
        self.mesh = mesh
        self.axis_name = axis_name
        self.num_devices = int(mesh.shape[axis_name])
        self.param_specs = param_specs
        self.tensor_axis = tensor_axis(param_specs, mesh, axis_name)
        self.data_axes = tuple(a for a in mesh.axis_names if a not in (axis_name, self.tensor_axis))
        self.data_parallel_size = math.prod(int(mesh.shape[a]) for a in self.data_axes)
        self.schedule_spec = schedule
        self.num_microbatches = num_microbatches
        self.num_stages = num_stages
        self.costs = costs
        self.mem_limit = mem_limit
        self.w_mem = w_mem
        self.partitioner = partitioner
        if placement is not None:
            placement = tuple(
                _whole_number(f"placement[{s}]", d, 0) for s, d in enumerate(placement)
            )
        self.placement = placement
        if keep_buffers is None:
            keep_buffers = all(d.platform == "cpu" for d in np.ravel(mesh.devices))
        self.keep_buffers = _flag("keep_buffers", keep_buffers)
        pack_ticks = _flag("pack_ticks", pack_ticks, allow_none=True)
        # By default ticks are packed only by costs the user measured: the static estimates can be
        # far off on small stages (2-core CPU demo GPT: 5.6% slower packed by them).
        self.pack_ticks = costs is not None if pack_ticks is None else pack_ticks
        self._pools: dict[int, Buffers] = {}  # id(_Built) -> arenas kept between calls
        # id(_Built) -> (it, its forward-only step for pipe.value)
        self._forward_steps: dict[int, tuple[_Built, Lowering, Callable[..., Any]]] = {}
        self._cut_aux_rows: Callable[..., tuple[bool, ...]] | None = None  # (``_aux_rows``)
        if isinstance(schedule, Schedule):
            self._check_schedule(schedule)
        self._params_avals: tuple | None = None
        self._params_treedef: Any = None
        self._params_paths: tuple[str, ...] = ()  # their key paths, to name a leaf that differs
        self._built: dict[Any, _Built] = {}
        # Jitted global norms of staged values, by their layouts' fingerprints.
        self._norm_programs: dict[tuple, Callable[[list], jax.Array]] = {}
        # The build staged params follow: the first, or the latest call's whose trace is cut
        # alike (or pipe.stage(params, batch, key)'s); and its inputs' avals, for report()
        self._last: _Built | None = None
        self._last_inputs: tuple | None = None
        self._permutes_checked: set[tuple[int, str]] = set()  # (id(_Built), "step" or "forward")

    # ------------------------------------------------------------------ public surface

    @_agreeing
    def value_and_grad(
        self,
        params: Any,
        batch: Any,
        key: jax.Array | None = None,
        *,
        buffers: Buffers | None = None,
    ):
        """Returns (mean loss over microbatches, grads in the layout ``params`` came in).

        With ``has_aux=True`` (``zbjax.pipeline``), ``loss_fn`` returns ``(loss, aux)`` and this
        returns ``((loss, aux), grads)`` as ``jax.value_and_grad(..., has_aux=True)`` does,
        each aux leaf averaged over the microbatches (and data-parallel shards) like the loss.

        With ``key``, ``loss_fn`` is called as ``loss_fn(params, microbatch, key_i)`` with
        ``key_i = jax.random.fold_in(key, i)`` for microbatch ``i`` (with more than one
        data-parallel shard, shard ``s`` of it gets ``jax.random.fold_in(key_i, s)``).

        With ``buffers`` (from ``init_buffers``, or returned by the previous step), the step
        keeps its residuals and W's stash in them and returns (loss, grads, buffers): pass
        the returned ones to the next step. Inside your ``jax.jit``, donate them
        (``donate_argnums``) and return them, so that no step allocates or zeroes that memory
        (on CPU a memory pass per step, which ``keep_buffers`` saves only outside a ``jit``).
        Outside a ``jit`` the buffers passed in are donated and deleted.
        """
        _refuse_shapes("value_and_grad", params=params, batch=batch, key=key)
        self._check_devices(params=params, batch=batch, key=key)
        built = self._get(params, batch, key)
        if buffers is not None:
            self._check_buffers(buffers, built)
            self._check_permutes(built, built.step_with_pools, params, batch, key, buffers)
            return built.step_with_pools(params, batch, key, buffers)
        if self.keep_buffers and not _traced((params, batch, key)) and not checking_numerics():
            # The arenas of the previous call are donated to this one, so no step spends time
            # allocating and initialising them.
            pools = self._pools.pop(id(built), None) or _new_buffers(built)
            # Only the latest shape's arenas stay: a loop over many batch shapes would keep
            # a set per shape (another shape's call allocates its own again).
            self._pools.clear()
            self._check_permutes(built, built.step_with_pools, params, batch, key, pools)
            loss, grads, self._pools[id(built)] = built.step_with_pools(params, batch, key, pools)
            return loss, grads
        self._check_permutes(built, built.step, params, batch, key)
        return built.step(params, batch, key)

    @_agreeing
    def value(self, params: Any, batch: Any, key: jax.Array | None = None) -> Any:
        """Returns what ``value_and_grad`` returns first (the mean loss over microbatches, or
        ``(loss, aux)`` with ``has_aux``) running only the forwards: for evaluation.

        It runs the training step's pipeline (stages, placement, exchanges) through the
        forwards of its schedule alone (``Schedule.forwards``: each device runs its F actions
        as soon as their inputs arrive), storing no residuals and running no backward tick.
        It takes ``params`` in either layout, as ``value_and_grad`` does, and its loss is the
        same computation's. Compiled once per set of input shapes, beside the training step.
        """
        _refuse_shapes("value", params=params, batch=batch, key=key)
        self._check_devices(params=params, batch=batch, key=key)
        try:
            built = self._get(params, batch, key)
        except StagedLayoutError:
            # Evaluated without the key training had (or another change that cuts the model
            # elsewhere): the rows, unstaged, run this trace's own cut.
            params = self.unstage(params)
            built = self._get(params, batch, key)
        kept = self._forward_steps.get(id(built))
        if kept is None or kept[0] is not built:  # (a build not cached may reuse an id)
            kept = (built, *self._forward_step(built, key is not None))
            # A build closing over the enclosing trace's values is not cached; nor is its
            # forward step (it would keep that trace's constants alive, one per call).
            if any(b is built for b in self._built.values()):
                self._forward_steps[id(built)] = kept
        forward = kept[2]
        self._check_permutes(built, forward, params, batch, key, what="forward")
        return forward(params, batch, key)

    def _forward_step(self, built: _Built, with_key: bool) -> tuple[Lowering, Callable[..., Any]]:
        """Returns the lowering and the jitted step of ``built``'s forward pass: the forwards
        of its schedule (``Schedule.forwards``, each device's F as their inputs arrive) over stage
        programs that compute their outputs alone (``split.forwards_only``), so no residual
        is stored and no backward tick runs."""
        low = built.lowering
        tensor = None
        if low.layout.tensor_size > 1:
            tensor = (low.layout.tensor_axis, low.layout.tensor_size, low.layout.leaf_split)
        forward = lower(
            built.graph,
            tuple(forwards_only(p) for p in built.programs),
            low.schedule.forwards(),
            self.mesh,
            self.axis_name,
            None,
            tensor,
            low.key_leaf,
        )
        # The params' rows are the training step's: same stages, placement and leaves.
        assert forward.layout.fingerprint == low.layout.fingerprint
        step_fn = self._step_fn(forward, built.graph, with_key)
        step = jax.jit(lambda params, batch, key=None: step_fn(params, batch, key, None)[0])
        return forward, step

    @_agreeing
    def init_buffers(self, params: Any, batch: Any, key: jax.Array | None = None) -> Buffers:
        """Returns new arenas for ``value_and_grad(params, batch, key, buffers=...)``
        with inputs of these shapes (each device's rows on it; ``params`` in either layout)."""
        return _new_buffers(self._get(params, batch, key))

    def lower(
        self,
        params: Any,
        batch: Any,
        key: jax.Array | None = None,
        *,
        buffers: Buffers | None = None,
    ) -> jax.stages.Lowered:
        """Returns the jitted step's ``Lowered`` for these inputs: ``.compile()`` gives the
        step, called as ``compiled(params, batch)`` (``compiled(params, batch, key)`` when
        lowered with a key), returning what ``value_and_grad`` returns.

        With ``buffers``, the step that takes them (donated) as a fourth argument and returns
        (loss, grads, buffers), as ``value_and_grad(..., buffers=)`` runs it:
        ``compiled(params, batch, key, buffers)``, with ``key`` None if ``loss_fn`` takes none.
        """
        self._check_devices(params=params, batch=batch, key=key)
        built = self._get(params, batch, key, agree=False)
        if buffers is not None:
            self._check_buffers(buffers, built)
            self._check_permutes(built, built.step_with_pools, params, batch, key, buffers)
            return built.step_with_pools.lower(params, batch, key, buffers)
        self._check_permutes(built, built.step, params, batch, key)
        return (
            built.step.lower(params, batch) if key is None else built.step.lower(params, batch, key)
        )

    @_agreeing
    def profile(
        self,
        params: Any,
        batch: Any,
        key: jax.Array | None = None,
        *,
        steps: int = 3,
        trace_dir: str | None = None,
    ) -> ActionTimes:
        """Returns each action's time in the compiled step, per device, read from a
        ``jax.profiler`` trace of ``steps`` steps (``zbjax.trace``).

        The step runs as ``value_and_grad(..., buffers=)`` runs it, compiled once, warmed up,
        timed untraced ``steps`` times (``step_seconds`` is the median), then traced ``steps``
        times into ``trace_dir`` (kept there; a temporary directory when None;
        ``traced_step_seconds`` is their mean, the basis of the per-step times the trace
        gives: one slow traced step raises both).
        ``.table()`` returns it as text to print; ``.per_run("W s1")`` is the time one W of
        stage 1 took, to set beside ``measure_costs``, which times each action alone.
        """
        steps = _whole_number("steps", steps)
        if trace_dir is not None:
            if not isinstance(trace_dir, str | os.PathLike):
                raise PipelineError(
                    f"trace_dir={trace_dir!r}; pass a directory path (a str or os.PathLike)"
                )
            make_output_dir("trace_dir", trace_dir)
        _refuse_shapes("profile", params=params, batch=batch, key=key)
        _refuse_traced("profile", params=params, batch=batch, key=key)
        self._check_devices(params=params, batch=batch, key=key)
        built = self._get(params, batch, key)
        held = [_new_buffers(built)]
        self._check_permutes(built, built.step_with_pools, params, batch, key, held[0])
        compiled = built.step_with_pools.lower(params, batch, key, held[0]).compile()

        def run():
            *_, held[0] = jax.block_until_ready(compiled(params, batch, key, held[0]))

        def timed() -> float:
            began = time.perf_counter()
            run()
            return time.perf_counter() - began

        run()
        untraced = [timed() for _ in range(steps)]
        with contextlib.ExitStack() as stack:
            where = trace_dir or stack.enter_context(tempfile.TemporaryDirectory())
            try:
                jax.profiler.start_trace(where)
            except RuntimeError as err:
                raise PipelineError(
                    f"a jax.profiler trace is already running ({err}); stop it "
                    "(jax.profiler.stop_trace()) before pipe.profile, which traces the steps "
                    "itself"
                ) from err
            try:
                traced = [timed() for _ in range(steps)]
            finally:
                jax.profiler.stop_trace()
            return action_times(
                where,
                compiled.as_text(),
                steps,
                built.lowering.schedule,
                statistics.median(untraced),
                statistics.mean(traced),
            )

    def _check_devices(self, **trees: Any) -> None:
        """Raises PipelineError naming an input array committed to devices other than the
        mesh's (``jax.device_put(x, device)``, a checkpoint restored to one device): the jitted
        step cannot take it beside arrays on the mesh (JAX's "incompatible devices"), and a
        ``jax.set_mesh`` context of another mesh around the call."""
        context = jax.sharding.get_abstract_mesh()
        if not context.empty and jax.sharding.AxisType.Manual in context.axis_types:
            manual = [
                repr(n)
                for n, t in zip(context.axis_names, context.axis_types, strict=True)
                if t == jax.sharding.AxisType.Manual
            ]
            named = f"axes {', '.join(manual)} are" if len(manual) > 1 else f"axis {manual[0]} is"
            raise PipelineError(
                f"the call runs inside jax.shard_map or jax.pmap (the mesh's {named} manual "
                "there), but a "
                "pipelined step is itself a shard_map over pipe.mesh; call pipe.value_and_grad "
                "outside it (inside jax.jit is fine), and let the mesh's other axes do the "
                "data parallelism"
            )
        if not context.empty and context != self.mesh.abstract_mesh:

            def axes(mesh: Any) -> str:
                return ", ".join(
                    f"{n!r}: {size} {t.name}"
                    for (n, size), t in zip(mesh.shape.items(), mesh.axis_types, strict=True)
                )

            raise PipelineError(
                f"the call runs inside jax.set_mesh of a mesh with axes {{{axes(context)}}}, "
                f"but this pipeline runs on its own mesh {{{axes(self.mesh)}}}; call it outside "
                "that context, or set the pipeline's mesh (jax.set_mesh(pipe.mesh)), or build "
                "the pipeline on the context's mesh"
            )
        devices = set(self.mesh.devices.flat)
        order = tuple(self.mesh.devices.flat)
        in_context = context_mesh_devices()
        if in_context is not None and in_context != order:
            raise PipelineError(
                f"the call runs inside jax.set_mesh of a mesh of devices "
                f"{[d.id for d in in_context]}, but this pipeline's mesh holds devices "
                f"{[d.id for d in order]} (the same axes; other devices or another order); "
                "call it outside that context, set the pipeline's mesh "
                "(jax.set_mesh(pipe.mesh)), or build the pipeline on the context's mesh"
            )

        def reordered(x: Any) -> bool:
            # The mesh's devices in another order (a mesh made from a permuted device list):
            # jax.jit compares device orders too, and fails on our own internal arrays.
            sharding = x.sharding
            return (
                isinstance(sharding, jax.sharding.NamedSharding)
                and tuple(sharding.mesh.devices.flat) != order
            )

        def elsewhere(x: Any) -> bool:
            return (
                isinstance(x, jax.Array)
                and not isinstance(x, jax.core.Tracer)
                and x.committed
                and (x.sharding.device_set != devices or reordered(x))
            )

        for what, tree in trees.items():
            if not any(elsewhere(x) for x in jax.tree.leaves(tree)):
                continue  # (paths are looked up only for the message)
            for path, x in jax.tree_util.tree_leaves_with_path(tree):
                if elsewhere(x):
                    ids = sorted(d.id for d in x.sharding.device_set)
                    name = f"{what} leaf {jax.tree_util.keystr(path) or '(the ' + what + ')'} is"
                    if isinstance(tree, StagedParams):  # moved, or staged on other devices
                        name = "the staged params' rows are"
                        fix = (
                            "bring them to this pipeline's devices: pass jax.device_get(staged) "
                            "(the step takes rows on the host) or pipe.stage(pipe.unstage("
                            "staged)); rows another pipeline staged: "
                            "pipe.stage(other_pipe.unstage(staged))"
                        )
                    else:
                        fix = (
                            f"put the {what} on the mesh first: jax.device_put({what}, "
                            "NamedSharding(pipe.mesh, PartitionSpec()))"
                            + (" or pipe.stage(params)" if what == "params" else "")
                        )
                    if x.sharding.device_set == devices:
                        shown = [d.id for d in x.sharding.mesh.devices.flat]
                        where = (
                            f"committed to a mesh of devices {shown}, the pipeline mesh's "
                            f"devices in another order ({[d.id for d in order]}), which the "
                            "jitted step cannot take"
                        )
                    else:
                        s = "s" if len(ids) > 1 else ""
                        inside = set(ids) <= {d.id for d in devices}
                        where = (
                            f"committed to device{s} {ids}"
                            + (" only" if inside else "")
                            + f", not to the pipeline mesh's {len(devices)} devices, so the "
                            "jitted step cannot take it"
                        )
                    raise PipelineError(f"{name} {where}; {fix}")

    def _check_permutes(self, built: _Built, step: Any, *args: Any, what: str = "step") -> None:
        """Raises PipelineError before a tensor-parallel step that would hang on XLA:CPU
        (``tensor.check_stage_permutes``), read from ``step`` compiled for ``args`` once per
        build (and ``what``: the training step, or the forward-only one). The compiled step is
        cached, so the call that follows does not compile again (inside a user's ``jit``,
        whose program is compiled as a whole, it is a compile more)."""
        if (
            self.tensor_axis is None
            or (id(built), what) in self._permutes_checked
            or self.mesh.devices.flat[0].platform != "cpu"
        ):
            return
        hlo = step.lower(*args).compile().as_text()
        check_stage_permutes(hlo, self.mesh, self.axis_name, self.tensor_axis)
        self._permutes_checked.add((id(built), what))

    def _check_buffers(self, buffers: Any, built: _Built) -> None:
        if not isinstance(buffers, Buffers):
            raise PipelineError(
                f"buffers= takes the Buffers that pipe.init_buffers(params, batch) made (or the "
                f"previous step returned), not a {type(buffers).__name__}"
            )
        want = [(tuple(a.shape), np.dtype(a.dtype)) for a in built.lowering.pool_avals()]
        got = [(tuple(np.shape(p)), np.dtype(p.dtype)) for p in buffers.pools]
        if got != want:
            raise PipelineError(
                f"buffers hold pools {got} but the step for these inputs' shapes needs {want}; "
                "make them with pipe.init_buffers(params, batch) for inputs of these shapes"
            )
        mesh_devices = set(self.mesh.devices.flat)
        if any(
            isinstance(p, jax.Array)
            and not isinstance(p, jax.core.Tracer)
            and not p.is_deleted()
            and set(p.sharding.device_set) != mesh_devices
            for p in buffers.pools
        ):
            raise PipelineError(
                "these buffers lie on other devices than this pipeline's mesh (another "
                "pipeline's pipe.init_buffers made them); make them with this pipeline's "
                "pipe.init_buffers(params, batch)"
            )
        if any(
            isinstance(p, jax.Array) and not isinstance(p, jax.core.Tracer) and p.is_deleted()
            for p in buffers.pools
        ):
            raise PipelineError(
                "these buffers were donated to an earlier step, which deleted them; pass the "
                "buffers that step returned (loss, grads, buffers = pipe.value_and_grad(..., "
                "buffers=buffers))"
            )

    def measure_costs(
        self,
        params: Any,
        batch: Any,
        key: jax.Array | None = None,
        repeats: int = 10,
        comm: bool | None = None,
    ) -> Costs:
        """Returns each stage's F, B, W and fused BW time in seconds, measured on one device,
        and one tick's exchange between the devices as ``comm`` (one message per shift) and
        ``comm_message`` (what a second message adds).

        Every stage program of this pipeline (built for ``batch``'s shapes) runs jitted alone
        on the first device of the mesh on the first microbatch (its data-parallel shard), F,
        B and W alternating, ``repeats`` times after a warm-up, each time ``profile.LOOP_RUNS``
        runs in a loop writing each run's outputs into a slot of pools kept between calls, as
        the tick loop writes its arenas (``profile.looped``); the medians per run are
        returned.
        ``comm``: also time one tick's ``ppermute`` of one and of two messages per shift over
        the pipeline axis, all devices at once (``profile.measure_exchange_costs``); a collective
        over the whole mesh.
        None (default): when every device of the mesh belongs to this process (else ``comm``
        is 0); True: always, so over several processes every process must call this.
        Pass the costs as ``costs=`` to a new ``zbjax.pipeline``: zb-auto and the DAG
        schedules plan with them, and the lowering packs actions into the spare time of
        ticks by them, weighing fewer ticks against longer ones by the exchanges' costs
        (``pack_ticks``).
        Over several processes each process times its own stages (arrays over other
        processes' devices count as this process's part of them), and every process plans
        with process 0's costs, so that all build the same program.
        """
        comm = _flag("comm", comm, allow_none=True)
        _refuse_shapes("measure_costs", params=params, batch=batch, key=key)
        _refuse_traced("measure_costs", params=params, batch=batch, key=key)
        repeats = _whole_number("repeats", repeats)
        if isinstance(params, StagedParams):
            raise PipelineError(
                "measure_costs takes params in the user layout (the stages read the user "
                "leaves); pass the params you would give value_and_grad before pipe.stage"
            )
        built = self._get(params, batch, key, agree=False)
        m, shards = self.num_microbatches, self.data_parallel_size
        device = next(
            d for d in np.ravel(self.mesh.devices) if d.process_index == jax.process_index()
        )
        # Arrays typed on a mesh of explicit axes are taken off it (their values, through the
        # host): JAX neither slices rows sharded over such axes nor runs a one-device program
        # on an array whose type still names the mesh. Arrays over other processes' devices
        # become this process's part of them.
        batch, params, key = _off_explicit_mesh(jax.tree.map(_this_process, (batch, params, key)))
        stacked = split_microbatches(batch, m)
        if key is not None:
            stacked = (stacked, microbatch_keys(key, m))
        micro = []
        for j, leaf in enumerate(jax.tree.leaves(stacked)):
            first = leaf[0]
            if first.ndim >= 1 and j != built.lowering.key_leaf:  # rows, split over the shards
                first = first[: first.shape[0] // shards]
            micro.append(jax.device_put(first, device))
        param_leaves = [jax.device_put(x, device) for x in jax.tree.leaves(params)]
        with no_mesh_context():  # the programs run on one device, not on a mesh the caller set
            costs = measure_stage_costs(built.graph, built.programs, param_leaves, micro, repeats)
        if comm is None:
            comm = all(d.process_index == jax.process_index() for d in self.mesh.devices.flat)
        if not comm:
            return costs
        comm, comm_message = measure_exchange_costs(built.lowering, repeats)
        return dataclasses.replace(costs, comm=comm, comm_message=comm_message)

    @_agreeing
    def stage(self, params: Any, batch: Any = None, key: jax.Array | None = None) -> StagedParams:
        """Returns ``params`` in the staged layout: row ``d`` of each dtype on device ``d``.

        The layout comes from the traced program. Before the first ``value_and_grad`` call,
        pass an example ``batch`` (and ``key``, if ``loss_fn`` takes one) so the pipeline can be
        built from its shapes; nothing is compiled. Params and batch given as
        ``jax.ShapeDtypeStruct``s (their shapes only) give the staged rows' shapes and
        shardings, as ``jax.eval_shape`` would, e.g. the target for restoring a checkpoint of
        staged params, and build the pipeline so that the restored rows can run.
        """
        if batch is not None:
            # The staged layout is the one these inputs trace to (an evaluation without the
            # key before it may have built another).
            self._get(params, batch, key, stage_for=True)
        built = self._require_built("pipe.stage()")
        leaves = self._check_params(params)
        layout = built.lowering.layout
        sharding = NamedSharding(self.mesh, self._rows_spec())
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            shapes = jax.eval_shape(lambda values: stage_leaves(layout, values), leaves)
            return jax.tree.map(
                lambda r: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=sharding), shapes
            )
        if self._several or any(_spread(x) for x in leaves):
            # Leaves this process holds whole but not as the program takes them (on one
            # device, another mesh or device order, this process's devices of a mesh over
            # several) come through the host.
            leaves = [
                np.asarray(x)
                if not _fits_mesh(x, self.mesh) and getattr(x, "is_fully_addressable", False)
                else x
                for x in leaves
            ]
        if any(_spread(x) for x in leaves) and all(_fits_mesh(x, self.mesh) for x in leaves):
            # Leaves sharded over several devices (a sharded init, a restored checkpoint,
            # global arrays over several processes) are joined by one program. Eagerly, each op
            # on them was a program over their devices: 400 such leaves queued more than
            # XLA:CPU's collectives survive (an abort in 5 of 6 runs), and over several
            # processes every process must run each. (Those over other processes' devices on
            # another mesh still join eagerly.)
            with no_mesh_context():  # a mesh the caller set is not the program's
                return built.stage_program(sharding)(leaves)
        staged = stage_leaves(layout, _on_one_device_set(_replicated(leaves, self.mesh)))
        return jax.tree.map(lambda r: jax.device_put(r, sharding), staged)

    def _rows_spec(self) -> PartitionSpec:
        """Returns how staged rows lie on the mesh: row d on pipeline device d, and over a
        tensor axis each device holding its block."""
        return PartitionSpec(self.axis_name, self.tensor_axis)

    def unstage(self, staged: StagedParams) -> Any:
        """Returns ``staged`` (params, grads or updates in the staged layout) as a tree in the
        user's layout: a tied leaf's first copy (its copies hold the same values), a leaf split
        over devices by rows put back together."""
        if not isinstance(staged, StagedParams):
            raise PipelineError(
                f"pipe.unstage takes staged params (a zbjax.StagedParams from pipe.stage), got "
                f"a {type(staged).__name__}; params in your own layout need no unstaging"
            )
        built = self._require_built("pipe.unstage()")
        # Rows of an earlier staged layout of this pipeline unstage by theirs.
        built = next(
            (b for b in self._built.values() if b.lowering.layout.fingerprint == staged.layout),
            built,
        )
        self._check_staged(staged, built, widened=True)
        local = all(
            not isinstance(r, jax.core.Tracer) and getattr(r, "is_fully_addressable", True)
            for r in staged.rows
        )
        if not local:  # traced, or rows over other processes' devices: sliced as JAX values
            if any(isinstance(r, jax.core.Tracer) for r in staged.rows):
                leaves = unstage_leaves(built.lowering.layout, _replicated(staged, self.mesh))
            else:
                # One program, run by every process: sliced eagerly, each slice was a program
                # over every process's devices, and dozens of them queued at once stalled
                # XLA:CPU's collectives across processes (benchmarks/multiprocess_unstage.py).
                with no_mesh_context():
                    leaves = built.unstage_program(staged)
            return jax.tree_util.tree_unflatten(self._params_treedef, leaves)
        # Eagerly: slice the rows on the host (NumPy reads a sharded row whole). Slicing them
        # on the devices ran one program per leaf (a compile per distinct slice: 20 s for 1000
        # small leaves) and queued more sharded executions than XLA:CPU's in-process
        # collectives survive. The leaves are left uncommitted on the default device, as
        # jnp.asarray leaves them: placed on the mesh (Explicit axes) they failed in eager JAX
        # outside jax.set_mesh.
        host = jax.tree.map(np.asarray, staged)
        leaves = unstage_leaves(built.lowering.layout, host)
        placed = [jnp.asarray(leaf) for leaf in leaves]
        return jax.tree_util.tree_unflatten(self._params_treedef, placed)

    def global_norm(self, tree: Any) -> jax.Array:
        """Returns the L2 norm of params or grads, given staged or in the user layout.

        In the staged layout a tied leaf is stored (and its gradient returned) once per device
        that reads it, and rows are padded, so ``optax.tree.norm`` of staged grads counts a
        tied leaf twice; this counts every element once and equals ``optax.tree.norm`` of
        the user-layout tree (integer and bool leaves included, squared in float32 where
        optax squares them in their own dtype, which wraps around for large values; complex
        leaves by modulus).
        Works under ``jax.jit``.
        """
        # Staged values may sit inside a container ({"grads": grads}, (grads, aux)): each is
        # counted through the layout, any other leaf as it is.
        nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, StagedParams))
        values, layouts = [], []
        for node in nodes:
            if isinstance(node, StagedParams):
                built = self._require_built("pipe.global_norm() of staged values")
                self._check_staged(node, built, widened=True)
                values.append(node)
                layouts.append(built.lowering.layout)
                continue
            try:
                values.append(node if isinstance(node, jax.Array) else jnp.asarray(node))
            except TypeError:
                raise PipelineError(
                    f"pipe.global_norm takes params or grads (staged or in the user layout); "
                    f"a leaf is a {type(node).__name__} ({node!r:.40}), not an array"
                ) from None
            layouts.append(None)
        norm = functools.partial(_global_norm, tuple(layouts))
        arrays = jax.tree.leaves(values)
        if (
            all(layout is None for layout in layouts)
            or _traced(arrays)
            or not all(_fits_mesh(x, self.mesh) for x in arrays)
        ):
            return norm(values)
        # Eagerly, staged rows are counted by one program: op by op, each op was a program
        # over the mesh (14 for a small GPT's grads, which over two processes, with a few
        # steps' worth queued, stalled XLA:CPU's collectives: helper H1, session 45).
        key = tuple(None if layout is None else layout.fingerprint for layout in layouts)
        if key not in self._norm_programs:
            self._norm_programs[key] = jax.jit(norm)
        with no_mesh_context():
            return self._norm_programs[key](values)

    def clip_by_global_norm(self, max_norm: float):
        """Returns an optax transformation like ``optax.clip_by_global_norm(max_norm)`` whose
        norm is ``self.global_norm``, so that clipping staged grads scales them exactly as
        clipping the user-layout grads would (staged or user-layout updates both work)."""
        import optax

        # A number (Python, NumPy, a 0-d array), or a traced scalar (a schedule's value).
        if not isinstance(max_norm, jax.core.Tracer):
            number = real_number(max_norm)
            if number is None or not number >= 0:  # NaN fails >= too
                raise PipelineError(
                    f"max_norm={max_norm!r}; pass a number >= 0 (the largest global norm: a "
                    "negative one would flip every clipped update, NaN make them all NaN)"
                )

        def update(updates, state, params=None):
            del params
            norm = self.global_norm(updates)
            limit = jnp.asarray(max_norm).astype(norm.dtype)
            under = norm < limit

            def clip(u):  # as optax: unchanged under the limit, else scaled to norm max_norm
                u = jnp.asarray(u)
                if not jnp.issubdtype(u.dtype, jnp.inexact):
                    return u
                # A 16-bit update is scaled in float32: a norm above its largest finite value
                # (65504 for float16) cast to it was inf, and every update 0.
                wide = wide_dtype(u.dtype)
                scaled = (u.astype(wide) / norm.astype(wide)) * limit.astype(wide)
                return jax.lax.select(under, u, scaled.astype(u.dtype))

            return jax.tree.map(clip, updates), state

        return optax.GradientTransformation(lambda params: optax.EmptyState(), update)

    def per_leaf(self, tx: Any) -> Any:
        """Returns an optax transformation of staged params that runs ``tx`` on each device's
        parameter leaves in the user's tree structure (``zbjax.optim``).

        Element-wise optimizers (``optax.adamw(lr)``, ``adam``, ``sgd``, ``lion``) give the
        same result on the staged rows as they are. Use ``per_leaf`` for one that looks at the
        tree: a mask (``optax.adamw(lr, mask=...)``), ``optax.multi_transform`` labels, or a
        leaf's shape or norm (``adafactor``, ``lamb``). Each device sees the leaves its stages
        hold (a leaf it holds some rows of, as those rows; one it does not hold, as None,
        which optax passes over) and nothing crosses devices, so keep a whole-tree
        transformation outside: ``optax.chain(pipe.clip_by_global_norm(1.0),
        pipe.per_leaf(optax.adamw(1e-3, mask=decay_mask)))``. Works under ``jax.jit``. Its
        compile grows with the leaves (each device's branch runs ``tx`` on its own leaves):
        on the demo GPT it compiled the update in 2.8 s against 0.15 s for ``optax.adamw`` on
        the rows (``python benchmarks/optimizer.py``), and on trees of thousands of small
        leaves in minutes, so use an element-wise optimizer without a mask on the rows.
        """

        if not callable(getattr(tx, "init", None)) or not callable(getattr(tx, "update", None)):
            raise PipelineError(
                f"pipe.per_leaf takes an optax GradientTransformation (with init and update), "
                f"not a {type(tx).__name__}; e.g. pipe.per_leaf(optax.adamw(1e-3, mask=...))"
            )

        def layout():
            return self._require_built("pipe.per_leaf(tx)").lowering.layout, self._params_treedef

        return per_leaf(tx, layout=layout, mesh=self.mesh, axis=self.axis_name)

    @property
    def graph(self) -> StageGraph:
        """Returns the stage graph of the latest build staged params follow (after the first
        call; a call in your layout whose trace is cut elsewhere runs a build of its own)."""
        return self._require_built("pipe.graph").graph

    @property
    def programs(self) -> tuple[StageProgram, ...]:
        """Returns the F/B/W/BW stage programs of the latest build."""
        return self._require_built("pipe.programs").programs

    @property
    def partitioner_used(self) -> str:
        """Returns the partitioner that made the latest build's stages.

        One of "markers", "chain", "graph" (with ``num_stages`` and the default partitioner,
        "markers" where the markers made that many stages, else "chain").
        """
        return self._require_built("pipe.partitioner_used").partitioner

    @property
    def schedule(self) -> Schedule:
        """Returns the schedule the latest build staged params follow runs (as ``graph``)."""
        return self._require_built("pipe.schedule").schedule

    @property
    def lowering(self) -> Lowering:
        """Returns the latest build's lowering: tick tables, staged layout, slot sizes."""
        return self._require_built("pipe.lowering").lowering

    def report(self, compiled: jax.stages.Compiled | None = None) -> str:
        """Returns stages, schedule grid, simulated bubble rate and compiled per-device memory.

        The memory is ``compiled``'s, a step compiled from ``pipe.lower(...).compile()``, when
        given; else the step is compiled again for the latest call's shapes (without their
        shardings, so it is a compile of its own).
        """
        if compiled is not None and not callable(getattr(compiled, "memory_analysis", None)):
            fix = " (call .compile() on it)" if callable(getattr(compiled, "compile", None)) else ""
            raise PipelineError(
                f"report(compiled=) takes a compiled step, pipe.lower(params, batch).compile(), "
                f"not a {type(compiled).__name__}{fix}"
            )
        built = self._require_built("pipe.report()")
        low = built.lowering
        if self.costs:  # what the pipeline was planned with (measured costs, say)
            costs, where = self.costs, "the costs it was planned with (costs=)"
        else:
            costs, where = program_costs(built.programs), "the stage programs' cost estimates"
        sim = schedules.simulate(built.schedule, costs)
        msg_bytes = low.slot_bytes()[3]
        lines = [
            f"zbjax pipeline: schedule {built.schedule.name}, {built.graph.num_stages} stages on "
            f"{self.num_devices} devices (axis {self.axis_name!r}), "
            + (
                f"each stage split over the {self.mesh.shape[self.tensor_axis]} devices of "
                f"tensor axis {self.tensor_axis!r}, "
                if self.tensor_axis is not None
                else ""
            )
            + (f"data parallel over {self.data_axes}, " if self.data_axes else "")
            + f"{self.num_microbatches} microbatches",
            "",
            # (The grid below may use measured costs=; these are always the estimates.)
            "stages (cost: the cost model's estimate of one forward, FLOPs and bytes):",
            stage_summary(built.graph),
            *_stage_dag_lines(built.graph, built.schedule, built.partitioner),
            *_measured_cost_lines(self.costs, built.graph.num_stages),
            "",
            f"schedule (simulated with {where}):",
            schedules.text_grid(built.schedule, sim),
            "",
            f"simulated bubble rate: {sim.bubble_rate:.3f}; makespan {sim.makespan:.4g}",
            *(
                [
                    "zb-auto's order, chosen by the time of its planned ticks (ticks."
                    "barrier_time with the costs it was planned with; 'screened': planned "
                    "without the segment search, more than 5 % behind): "
                    + ", ".join(
                        f"{name} {t:.4g}" + (" (runs)" if i == 0 else "")
                        for i, (name, t) in enumerate(built.in_ticks)
                    )
                ]
                if built.in_ticks
                else []
            ),
            f"lockstep ticks: {low.tables.num_ticks} ({low.tables.num_packed} actions packed "
            "after another in their tick); "
            f"activations between actions, per device: {_arena_text(low)}; in flight at "
            f"most: {low.tables.num_residual_slots} F to B, {low.tables.num_kept_slots} F to "
            f"W, {low.tables.num_stash_slots} B to W; message slots: "
            f"{low.tables.num_message_slots} x {msg_bytes:,} B",
            f"staged params per device: {low.layout.bytes_per_device():,} B",
        ]
        if compiled is None and self._last_inputs is not None:
            compiled = built.step.lower(*self._last_inputs).compile()
        if compiled is not None:
            mem = compiled.memory_analysis()
            if mem is not None:
                aliased = mem.alias_size_in_bytes
                lines.append(
                    "compiled per-device memory: "
                    f"arguments {mem.argument_size_in_bytes:,} B, "
                    f"outputs {mem.output_size_in_bytes:,} B"
                    + (f" ({aliased:,} B of them in donated arguments)" if aliased else "")
                    + f", temporaries {mem.temp_size_in_bytes:,} B"
                )
        return "\n".join(lines)

    # ------------------------------------------------------------------ building

    def _require_built(self, what: str) -> _Built:
        if self._last is None:
            raise PipelineError(
                f"{what} needs the traced program, which is built on the first call; "
                "call pipe.value_and_grad(params, batch) first, or pass an example batch: "
                "pipe.stage(params, batch) (params and batch may be jax.ShapeDtypeStructs, e.g. "
                "to run staged params restored from a checkpoint in a new process)"
            )
        return self._last

    def _check_params(self, params: Any) -> list:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        with_paths = jax.tree_util.tree_leaves_with_path(_avals(params, "params"))
        for path, aval in with_paths:
            if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
                raise PipelineError(
                    f"params leaf {jax.tree_util.keystr(path)} is a PRNG key "
                    f"({_shapes_text([aval])}), which jax.value_and_grad cannot take as a "
                    "param either; pass the key as pipe.value_and_grad(params, batch, key=key) "
                    "(loss_fn(params, microbatch, key_i) gets fold_in(key, i)), and keep RNG "
                    "state out of the params (e.g. nnx.split(model, nnx.Param, ...))"
                )
        avals = tuple(aval for _, aval in with_paths)
        paths = tuple(jax.tree_util.keystr(path) for path, _ in with_paths)
        if self._params_treedef is None:
            self._params_treedef, self._params_avals = treedef, avals
            self._params_paths = paths
        elif treedef != self._params_treedef or _strong(avals) != _strong(self._params_avals):
            raise PipelineError(_params_mismatch(self, treedef, paths, avals))
        # A Python scalar param is weakly typed and an array after an optimizer step: the
        # step is traced again for it (as jax.jit would), into the same staged layout.
        self._params_avals = avals
        return leaves

    def _check_staged(self, staged: StagedParams, built: _Built, widened: bool = False) -> None:
        """Raises PipelineError unless ``staged`` holds rows of this pipeline's layout; with
        ``widened``, rows of a 16-bit float dtype may hold float32 (the updates
        ``per_leaf`` returns for them) and integer or bool rows a float dtype (the updates
        optax computes for such leaves), as reading values out of rows allows."""
        layout = built.lowering.layout
        want = [(layout.num_devices, layout.row_width(k)) for k in range(len(layout.dtypes))]
        got = [tuple(np.shape(r)) for r in staged.rows]
        if staged.layout not in (None, layout.fingerprint):
            if any(b.lowering.layout.fingerprint == staged.layout for b in self._built.values()):
                raise PipelineError(
                    "staged params follow this pipeline's layout for other inputs, which a "
                    "later pipe.stage(params, batch, key) with inputs cut elsewhere (a key or "
                    "not, another batch shape) replaced; pipe.unstage them and stage them "
                    "again, or stage for the inputs you train with"
                )
            raise PipelineError(
                "staged params follow another pipeline's layout (another schedule, stage count, "
                "placement or, for an automatic cut, microbatch shape (num_microbatches, batch "
                "size, data-parallel size) puts the leaves elsewhere in the rows, though the "
                "rows' shapes may agree); pass this pipeline's pipe.stage(params), e.g. "
                "pipe.stage(other_pipe.unstage(staged))"
            )
        cast = [
            (dt, dtype_name(r.dtype))
            for dt, r in zip(staged.dtypes, staged.rows, strict=True)
            if hasattr(r, "dtype")
            and dtype_name(r.dtype) != dt
            and not (widened and _widened(dt, r.dtype))
        ]
        if cast:
            raise PipelineError(
                f"staged params rows of {', '.join(dt for dt, _ in cast)} now hold "
                f"{', '.join(now for _, now in cast)} (cast after pipe.stage, e.g. by "
                "jax.tree.map(lambda r: r.astype(...))), which this pipeline's layout does not "
                "hold (a pipeline is traced for its params' dtypes); keep the rows' dtypes, or "
                "build a new zbjax.pipeline for params of the new dtypes and stage them with "
                "its pipe.stage"
            )
        if tuple(staged.dtypes) != layout.dtypes or got != want:
            raise PipelineError(
                f"staged params have rows {list(zip(staged.dtypes, got, strict=True))} but "
                f"this pipeline's layout is {list(zip(layout.dtypes, want, strict=True))}; "
                "pass the output of this pipeline's pipe.stage(params)"
            )

    def _get(
        self, params: Any, batch: Any, key: Any, stage_for: bool = False, agree: bool = True
    ) -> _Built:
        """Returns the build for these inputs (building it on first use). Staged params need
        the build that made their layout (``_last``: the first build, or the latest
        ``pipe.stage(params, batch, key)``'s, ``stage_for``); a call in the user layout whose
        trace is cut elsewhere (without the key training takes: no dropout) runs its own
        build and leaves the staged layout as it is. Over several processes an eager call
        that runs on every device (``agree``) first checks that every process passed alike
        inputs (``_agree_on_call``); one process alone may lower or measure a built step."""
        if agree and self._several and not _traced((params, batch, key)):
            _agree_on_call(params, batch, key)
        first = self._params_treedef is None
        # The key and batch are checked first: a call refused for them binds the pipeline to
        # no params.
        key_aval = None if key is None else _avals(key, "key")
        if key_aval is not None:
            _check_key(key_aval)
        batch_avals = _avals(batch, "batch")
        if isinstance(params, StagedParams):
            built = self._require_built("pipe.value_and_grad with staged params")
            self._check_staged(params, built)
            # The rows hold arrays: every leaf is strongly typed, as jax.jit sees
            # pipe.unstage(rows) (a Python scalar param is weakly typed only until staged).
            # Where that cuts the model elsewhere (an automatic cut: bf16 * scale turns
            # float32 where scale is an array), the rows' layout decides: the weak types stay.
            strong = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self._params_avals)
            tries = [strong] if strong == self._params_avals else [strong, self._params_avals]
        else:
            self._check_params(params)  # the params' avals are this pipeline's from here on
            tries = [self._params_avals]
        for avals in tries:
            built = self._built_for(avals, batch, batch_avals, key_aval, first)
            if self._last is None or self._last.lowering.layout == built.lowering.layout:
                break
        else:
            if isinstance(params, StagedParams):
                raise StagedLayoutError(self._layout_change(batch_avals, key_aval))
            if not stage_for:
                return built  # user-layout params: this trace's own cut, for this call
        self._last = built
        # Avals, not values: under a user's jit these are tracers that must not outlive it.
        self._last_inputs = _avals((params, batch, key))
        return built

    @functools.cached_property
    def _several(self) -> bool:
        """Whether the mesh's devices belong to several processes."""
        return len({d.process_index for d in self.mesh.devices.flat}) > 1

    def _layout_change(self, batch_avals: Any, key_aval: Any) -> str:
        """Returns the error for staged params given with inputs whose trace is cut into
        stages holding other params than the staged layout's: what differs from the call
        that made that layout, and the fixes."""
        before = self._last_inputs
        differs = []
        if before is not None:
            had_key = before[2] is not None
            if had_key != (key_aval is not None):
                differs.append(
                    "it has no key where that call had one (dropout's equations are gone)"
                    if had_key
                    else "it has a key where that call had none (dropout's equations appear)"
                )
            if jax.tree.leaves(before[1]) != jax.tree.leaves(batch_avals):
                shapes = _shapes_text(jax.tree.leaves(batch_avals))
                was = _shapes_text(jax.tree.leaves(before[1]))
                differs.append(f"its batch is {shapes}, where that call's was {was}")
        what = "; ".join(differs) or "its params are weakly typed otherwise"
        return (
            "these inputs trace loss_fn differently from the call that made the staged params' "
            f"layout ({what}), and the automatic cut of this trace puts params on other stages, "
            "so the staged rows cannot run it. Place zbjax.stage_boundary markers (a marked "
            "cut is the same for every trace), pass the params in your tree layout "
            "(pipe.unstage(staged); pipe.value does so itself), or build another "
            "zbjax.pipeline for these inputs"
        )

    def _built_for(
        self, avals: tuple, batch: Any, batch_avals: Any, key_aval: Any, first: bool
    ) -> _Built:
        """Returns the build for params of ``avals`` (weak types included) and the batch's
        shapes, building it on first use."""
        cache_key = (
            tuple(a.weak_type for a in avals),
            jax.tree_util.tree_structure(batch),
            tuple(jax.tree.leaves(batch_avals)),
            None if key_aval is None else (key_aval.shape, str(key_aval.dtype)),
            tracing_config(),  # jax.default_matmul_precision(...) and the like: as jit would
        )
        if cache_key not in self._built:
            # Shapes decide the build, so a batch of known shapes needs no checking again
            # (tracing the microbatch split costs milliseconds of every step otherwise).
            params_avals = jax.tree_util.tree_unflatten(self._params_treedef, avals)
            try:
                micro = self._microbatch_avals(batch)
                # Costs are estimated for the devices the step runs on (CPU or accelerator).
                with cost_model.costs_for(self.mesh.devices.flat[0].platform):
                    built = self._build(params_avals, micro, key_aval, batch_avals)
            except BaseException:
                if first:  # params nothing was built for do not bind the pipeline to them
                    self._params_treedef = self._params_avals = None
                raise
            if any(closes_over_tracers(s.jaxpr.consts) for s in built.graph.stages):
                return built  # loss_fn read a value of the enclosing trace: valid there only
            self._built[cache_key] = built
        return self._built[cache_key]

    def _aux_rows(
        self, params_avals: Any, batch_avals: Any, key_aval: Any
    ) -> Callable[[list[tuple[int, ...]]], tuple[bool, ...]]:
        """Returns the function ``partition`` calls with the aux leaves' shapes for one
        data-parallel shard of one microbatch (from its own trace), which returns per leaf
        whether it holds per-example rows (``microbatch.aux_rows``, against its shape for the
        whole batch, traced once). The pipeline returns such a leaf joined over the
        microbatches and shards, as ``jax.value_and_grad`` of the unpipelined loss returns it,
        and the others as their means; a leaf that is neither is refused rather than returned
        wrong."""
        shards = self.data_parallel_size
        found: dict[tuple, tuple[bool, ...]] = {}

        def rows(parts: list[tuple[int, ...]]) -> tuple[bool, ...]:
            if tuple(parts) not in found:
                found[tuple(parts)] = whole_batch_aux_rows(
                    self.loss_fn,
                    params_avals,
                    batch_avals,
                    key_aval,
                    parts,
                    self.num_microbatches * shards,
                    f" on each of {shards} data-parallel shards" if shards > 1 else "",
                )
            return found[tuple(parts)]

        return rows

    def _microbatch_avals(self, batch: Any) -> Any:
        """Returns one microbatch's avals; raises PipelineError when rows do not divide."""
        stacked = jax.eval_shape(lambda b: split_microbatches(b, self.num_microbatches), batch)
        shards = self.data_parallel_size
        leaves, treedef = jax.tree_util.tree_flatten_with_path(stacked)
        counts = {jax.tree_util.keystr(path): a.shape[1] for path, a in leaves}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{name}: {rows}" for name, rows in counts.items())
            if shards > 1:
                # Each data-parallel shard takes its own block of every leaf's rows, so leaves
                # of different lengths would pair rows that the unpipelined loss never pairs.
                raise PipelineError(
                    f"batch leaves have different numbers of rows per microbatch ({listed}), "
                    f"so the {shards} data-parallel shards of mesh axes {self.data_axes} would "
                    "split them at different places; give every batch leaf the same leading "
                    "(batch) size, or pass per-step constants through params or a closure "
                    "instead"
                )
            # Legitimate (a flattened per-token leaf beside a [batch, seq] one), but a
            # per-step constant passed in the batch would be split up just the same.
            warnings.warn(
                f"batch leaves have different numbers of rows per microbatch ({listed}); "
                f"each leaf is split along axis 0 into {self.num_microbatches} microbatches, "
                "so a leaf that is not per-example (a lookup table, a per-step constant) is "
                "split up too; pass such values through params or a closure, or give every "
                "batch leaf the same leading (batch) size to silence this warning",
                stacklevel=caller_stacklevel(),
            )
        micro = []
        for path, a in leaves:
            rows = a.shape[1] if len(a.shape) >= 2 else None
            if rows is not None and rows % shards:
                raise PipelineError(
                    f"batch leaf {jax.tree_util.keystr(path)} has {rows} rows per microbatch "
                    f"({a.shape[1] * self.num_microbatches} / num_microbatches="
                    f"{self.num_microbatches}), which the {shards} data-parallel shards of mesh "
                    f"axes {self.data_axes} cannot split evenly; use a batch size that is a "
                    f"multiple of {self.num_microbatches * shards}"
                )
            shape = a.shape[1:] if rows is None else (rows // shards, *a.shape[2:])
            micro.append(jax.ShapeDtypeStruct(shape, a.dtype))
        return jax.tree_util.tree_unflatten(jax.tree.structure(stacked), micro)

    def _build(self, params_avals: Any, micro: Any, key_aval: Any, batch_avals: Any) -> _Built:
        try:
            return self._build_here(params_avals, micro, key_aval, batch_avals)
        except _PeerFailed:
            raise
        except Exception as err:
            if self._several:
                # The other processes wait at this build's next exchange: they raise there now.
                _post_failure(err)
            raise

    def _build_here(self, params_avals: Any, micro: Any, key_aval: Any, batch_avals: Any) -> _Built:
        """Builds the step; where the mesh spans processes, they agree on the plan and check
        that they built the same program (``_exchanged``)."""
        several = self._several
        tensor = None
        if self.param_specs is not None:  # checked against the params even if none is split
            axis = self.tensor_axis
            size = int(self.mesh.shape[axis]) if axis is not None else 1
            splits = leaf_splits(self.param_specs, params_avals, axis, size)
            tensor = (axis, size, splits) if axis is not None else None
        # Which aux leaves hold per-example rows, for every cut below (``_cut``).
        self._cut_aux_rows = (
            self._aux_rows(params_avals, batch_avals, key_aval) if self.has_aux else None
        )
        kind, parted = self._partition(params_avals, micro, key_aval)
        graph = parted.graph
        if tensor is not None:
            paths = jax.tree_util.tree_leaves_with_path(params_avals)
            paths = [jax.tree_util.keystr(p) for p, _ in paths]
            check_row_splits(
                tensor[2],
                [list(zip(s.param_leaves, s.param_slices(), strict=True)) for s in graph.stages],
                lambda leaf: paths[leaf],
            )
        programs = split(graph)
        _warn_host_residuals(programs)
        if several:
            # Measured costs are each process's own timings: planned with, they would give
            # each process another program (a collective mismatch). All plan with process 0's
            # and pack ticks as it does (costs given to process 0 only are used everywhere).
            # What each asked for must agree before any plan is made from process 0's.
            requested = (self.schedule_name, self.num_microbatches)
            every = _exchanged((requested, self.costs, self.pack_ticks))
            if every is not None:
                _refuse_different([part[0] for part in every])
                _, self.costs, self.pack_ticks = every[0]
        schedule = self._schedule(graph, programs, parted.placement, kind)
        if several:  # a search given time_limit= stops by each process's clock
            schedule = _from_first_process(schedule)
        costs = (self.costs or program_costs(programs)) if self.pack_ticks else None
        in_ticks: tuple[tuple[str, float], ...] = ()
        plan = None
        if costs is not None and self.schedule_spec == "zb-auto":
            schedule, in_ticks, (planned, at) = zb_auto_in_ticks(
                schedule, costs, graph.empty_backward
            )
            plan = TickPlan(schedule, planned, at)
        # The keys are the last batch leaf: (microbatches, keys) flattened.
        key_leaf = len(graph.batch_avals) - 1 if key_aval is not None else None
        lowering = lower(
            graph,
            programs,
            schedule,
            self.mesh,
            self.axis_name,
            costs,
            tensor,
            key_leaf,
            planned=plan,
        )
        if several:
            layout = (lowering.layout.fingerprint, _tree_text(params_avals))
            _check_same_program(graph, lowering.schedule, micro, layout)
        step_fn = self._step_fn(lowering, graph, key_aval is not None, training=True)
        step = jax.jit(lambda params, batch, key=None: step_fn(params, batch, key, None)[:2])

        def step_buffers(params, batch, key, buffers):
            loss, grads, pools = step_fn(params, batch, key, list(buffers.pools))
            return loss, grads, Buffers(tuple(pools))

        step_with_pools = jax.jit(step_buffers, donate_argnums=3)
        # The lowering's schedule is what runs (it may fuse a stage's empty B with its W).
        return _Built(
            graph, programs, lowering.schedule, lowering, step, kind, step_with_pools, in_ticks
        )

    def _partition(self, params_avals: Any, micro: Any, key_aval: Any) -> tuple[str, _Partitioned]:
        """Returns (the partitioner used, the stage graph and its placement if it chose one)."""
        kind = self.partitioner
        if kind == "auto" and self.num_stages is not None:
            # A fixed count: markers must make exactly that many stages, else a chain cut
            # (another batch shape keeping the first's, as below).
            graph = self._kept_cut(params_avals, micro, self.num_stages, key_aval)
            return ("markers" if graph.cut is None else "chain"), _Partitioned(graph)
        if kind in ("auto", "markers", "chain"):
            # One trace tells whether there are markers (num_stages=None never cuts by cost).
            marked = self._cut(params_avals, micro, key=key_aval)
            has_markers = marked.num_stages > 1
            if kind == "markers" and not has_markers:
                raise PipelineError(
                    "partitioner='markers' but loss_fn has no zbjax.stage_boundary markers; "
                    "place markers where stages should start, or use partitioner='chain' or "
                    "'graph' to cut automatically"
                )
            if kind == "chain" and has_markers:
                raise PipelineError(
                    f"partitioner='chain' balances stages by cost, but loss_fn has "
                    f"{marked.num_stages - 1} stage_boundary markers, which always decide the "
                    "cuts; use partitioner='markers' (or 'auto'), or remove the markers"
                )
            if kind == "auto":
                if has_markers:
                    kind = "markers"
                elif self._last is not None and self._last.partitioner in ("graph", "chain"):
                    kind = self._last.partitioner  # another batch shape keeps the first's
                elif self.schedule_name in schedules.DAG_SCHEDULE_NAMES and not isinstance(
                    self.schedule_spec, Schedule
                ):
                    kind = "graph"
                else:
                    kind = "chain"
        if kind == "markers":
            if self.num_stages is not None and self.num_stages != marked.num_stages:
                # partition() raises the error that names both counts.
                self._cut(params_avals, micro, num_stages=self.num_stages, key=key_aval)
            return kind, _Partitioned(marked)
        if kind == "graph" and (self.partitioner != "auto" or self._last is not None):
            return kind, self._graph_partition(params_avals, micro, key_aval)
        if kind == "graph":
            # GraphPipe keeps a scan over layers whole; the chain cut splits it. Each is traced
            # with its warnings held, and those of the one chosen are given.
            with warnings.catch_warnings(record=True) as graph_warnings:
                warnings.simplefilter("always")
                parted = self._graph_partition(params_avals, micro, key_aval)
            with warnings.catch_warnings(record=True) as chain_warnings:
                warnings.simplefilter("always")
                chain = self._chain_if_faster(parted, params_avals, micro, key_aval)
            for w in graph_warnings if chain is None else chain_warnings:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return ("graph", parted) if chain is None else ("chain", _Partitioned(chain))
        num_stages = self.num_stages
        if num_stages is None:
            num_stages = self.num_devices * (
                2 if self.schedule_name in TWO_STAGES_PER_DEVICE else 1
            )
        if num_stages == 1:
            return kind, _Partitioned(marked)
        return kind, _Partitioned(self._kept_cut(params_avals, micro, num_stages, key_aval))

    def _chain_if_faster(
        self, parted: _Partitioned, params_avals: Any, micro: Any, key_aval: Any
    ) -> StageGraph | None:
        """Returns the chain cut over the pp devices when GraphPipe's partition leaves a device
        without a stage or one stage above 1.5 times an even share of the cost (it keeps a scan
        over layers whole, where the chain cut splits its iterations) and the chain's step is
        predicted at least 10 % shorter; else None."""
        devices = self.num_devices
        costs = [stage.cost for stage in parted.graph.stages]
        placed = parted.placement is not None and len(set(parted.placement)) == devices
        if placed and max(costs) <= 1.5 * sum(costs) / devices:
            return None
        try:
            chain = self._kept_cut(params_avals, micro, devices, key_aval)
        except PartitionError:  # fewer pieces of work than devices
            return None
        m = self.num_microbatches
        if placed and _predicted_step(chain, m) >= 0.9 * _predicted_step(parted.graph, m):
            return None
        return chain

    def _kept_cut(
        self, params_avals: Any, micro: Any, num_stages: int, key_aval: Any
    ) -> StageGraph:
        """Returns the cost-balanced cut, or, once a pipeline is built, the cut that keeps its
        stages' params: another batch shape keeps the first cut (the costs, which scale with
        the shapes, may balance elsewhere), and so does a trace whose equations differ (a
        weakly typed param turned strong adds a cast): where the same cut positions would
        put params elsewhere, nearby positions are tried."""
        cut = None if self._last is None else self._last.graph.cut
        graph = self._cut(params_avals, micro, num_stages=num_stages, key=key_aval, cut=cut)
        if self._last is None or _stage_params(graph) == _stage_params(self._last.graph):
            return graph
        units, starts = graph.cut
        # An equation added or missing before a cut moves every later cut by the same count:
        # shift the cuts from each one on by up to 3 units, the smallest shifts first.
        for d, first in itertools.product((1, -1, 2, -2, 3, -3), range(1, len(starts))):
            moved = (*starts[:first], *(a + d for a in starts[first:]))
            if any(b <= a for a, b in itertools.pairwise(moved)) or moved[-1] >= units:
                continue
            candidate = self._cut(
                params_avals, micro, num_stages=num_stages, key=key_aval, cut=(units, moved)
            )
            if _stage_params(candidate) == _stage_params(self._last.graph):
                return candidate
        return graph

    def _cut(self, params_avals: Any, micro: Any, **kwargs: Any) -> StageGraph:
        return partition(
            self.loss_fn,
            params_avals,
            micro,
            has_aux=self.has_aux,
            tensor_axis=self.tensor_axis,
            aux_rows=self._cut_aux_rows,
            **kwargs,
        )

    def _graph_partition(self, params_avals: Any, micro: Any, key_aval: Any) -> _Partitioned:
        """Returns GraphPipe's stage DAG of the traced program over the pp devices."""
        chosen: list[graphpipe.GraphPartition] = []
        pieces: list[Any] = []  # the flat program's (equation, cost), for the warning below

        def assign(program: Any, num_params: int) -> tuple[int, ...]:
            op_graph = graphpipe.op_graph_from_jaxpr(program, num_params)
            pieces[:] = zip(program.jaxpr.eqns, op_graph.equation_costs, strict=True)
            parted = graphpipe.graph_partition(
                op_graph.graph, self.num_devices, self.num_microbatches
            )
            markers = sum(map(is_stage_boundary, program.jaxpr.eqns))
            if markers and self.placement is None and parted.num_stages < self.num_devices:
                raise ScheduleError(
                    f"partitioner='graph' cuts a marked loss_fn only at its markers and where "
                    f"its branches part: of the pieces its {markers} stage_boundary markers "
                    f"make, GraphPipe formed {parted.num_stages} stages for the "
                    f"{self.num_devices} devices of axis {self.axis_name!r}; remove the "
                    "markers to let GraphPipe cut the whole model, add markers, or use the "
                    "markers partitioner (partitioner='markers', or the default) with a smaller "
                    "pp axis"
                )
            chosen.append(parted)
            return op_graph.equation_stages(parted)

        graph = self._cut(params_avals, micro, key=key_aval, assign=assign)
        warn_whole_regions(pieces, self.num_devices, graph=True)
        parted = chosen[-1]
        graph = dataclasses.replace(
            graph,
            stages=tuple(
                dataclasses.replace(stage, name=f"{stage.name} ({name})")
                for stage, name in zip(graph.stages, parted.stage_names, strict=True)
            ),
        )
        return _Partitioned(graph, parted.placement)

    @property
    def schedule_name(self) -> str:
        return self._name_of(self.schedule_spec)

    @staticmethod
    def _name_of(spec: str | Schedule) -> str:
        return spec.name if isinstance(spec, Schedule) else spec

    def _dag_placement(
        self, graph: StageGraph, chosen: tuple[int, ...] | None, kind: str
    ) -> tuple[int, ...]:
        """Returns the device of each stage for a DAG schedule, or raises what to pass."""
        count, devices = graph.num_stages, self.num_devices
        placement = self.placement if self.placement is not None else chosen
        if placement is None:
            if count < devices:
                # GraphPipe cuts a marked model only at its markers: it would make no more.
                graph_fix = (
                    "remove the markers and use partitioner='graph' (GraphPipe cuts a marked "
                    "model only at its markers)"
                    if kind == "markers"
                    else "use partitioner='graph'"
                )
                raise ScheduleError(
                    f"{self.schedule_name}: the {kind} partition has {count} stages, fewer "
                    f"than the {devices} devices of axis {self.axis_name!r}, and every device "
                    f"needs a stage; use a pp axis of {count} devices, cut the model into "
                    f"{devices} stages (more markers), or {graph_fix}"
                )
            if count > devices:
                raise ScheduleError(
                    f"{self.schedule_name} needs the device of each stage: the {kind} "
                    f"partition has {count} stages but axis {self.axis_name!r} has {devices} "
                    f"devices; pass placement=(device of each stage, ...) with {count} entries "
                    f"over devices 0..{devices - 1}, use partitioner='graph' (which places its "
                    f"stages), or cut the model into exactly {devices} stages"
                )
            return tuple(range(count))
        if len(placement) != count or sorted(set(placement)) != list(range(devices)):
            source = "placement" if self.placement is not None else "GraphPipe's placement"
            raise ScheduleError(
                f"{source} {tuple(placement)} does not put the {count} stages of the {kind} "
                f"partition on all {devices} devices of axis {self.axis_name!r} (0..{devices - 1}, "
                "each used at least once); "
                + (
                    f"pass {count} device indices covering 0..{devices - 1}"
                    if self.placement is not None
                    else f"GraphPipe found too little work to spread over {devices} devices "
                    "(it keeps a lax.scan / nn.scan over layers and a jax.checkpoint region "
                    "whole): use partitioner='chain' (which splits a scan's iterations "
                    "between stages), a smaller pp axis, or markers with a placement"
                )
            )
        return tuple(placement)

    def _schedule(
        self,
        graph: StageGraph,
        programs: tuple[StageProgram, ...],
        chosen_placement: tuple[int, ...] | None = None,
        kind: str = "chain",
    ) -> Schedule:
        spec = self.schedule_spec
        if isinstance(spec, Schedule):
            schedule = spec
        elif spec in schedules.DAG_SCHEDULE_NAMES:
            schedule = schedules.build(
                spec,
                graph.num_stages,
                self.num_microbatches,
                costs=self.costs or program_costs(programs),
                mem_limit=self.mem_limit,
                w_mem=self.w_mem,
                edges=list(graph.edge_pairs),
                placement=self._dag_placement(graph, chosen_placement, kind),
                stage_names=tuple(stage.name for stage in graph.stages),
            )
        else:
            options = {}
            costs = self.costs
            if spec == "zb-auto":
                costs = costs or program_costs(programs)
                options["edges"] = graph.edge_pairs
            elif graph.edge_pairs != schedules.chain_edges(graph.num_stages) and not all(
                a < b for a, b in graph.edge_pairs
            ):
                raise PipelineError(
                    f"the stage graph has edges {list(graph.edge_pairs)}, which a chain "
                    f"schedule ({spec}) cannot order; use schedule='zb-auto' or a Schedule "
                    "built for this graph"
                )
            if spec in TWO_STAGES_PER_DEVICE and kind == "graph":
                raise ScheduleError(
                    f"{spec} puts 2 stages on every device, but partitioner='graph' makes at "
                    "most one stage per device; use partitioner='chain' (or markers) with "
                    f"{spec}, or a DAG schedule (dag-1f1b, dag-zb) with the graph partitioner"
                )
            if spec not in TWO_STAGES_PER_DEVICE and graph.num_stages != self.num_devices:
                count = graph.num_stages
                markers = self.num_devices - 1
                fix = {
                    "markers": f"place {markers} marker{'s' if markers != 1 else ''}",
                    "graph": "use partitioner='chain' (which cuts one stage per device)",
                }.get(kind, f"pass num_stages={self.num_devices}")
                raise ScheduleError(
                    f"{spec} runs one stage per device, but the {kind} partition has {count} "
                    f"stage{'s' if count != 1 else ''} on the {self.num_devices} devices of "
                    f"axis {self.axis_name!r}; use a pp axis of {count} "
                    f"device{'s' if count != 1 else ''}, {fix}, or a schedule that puts several "
                    "stages on a device (zb-v or interleaved-1f1b: exactly 2 per device; "
                    "dag-1f1b or dag-zb with placement=)"
                )
            if spec in TWO_STAGES_PER_DEVICE and graph.num_stages != 2 * self.num_devices:
                want = 2 * self.num_devices
                fix = (
                    f"the model's {graph.num_stages - 1} stage_boundary markers make "
                    f"{graph.num_stages}; place {want - 1} markers, or remove them and pass "
                    f"num_stages={want} to cut automatically,"
                    if kind == "markers"
                    else (
                        f"num_stages={self.num_stages} was given"
                        if self.num_stages is not None
                        else f"the model has {graph.num_stages}"
                    )
                    + f"; pass num_stages={want}"
                )
                raise ScheduleError(
                    f"{spec} needs 2 stages per device: {want} stages on the "
                    f"{self.num_devices} devices of axis {self.axis_name!r}, but {fix} or "
                    "choose a schedule with one stage per device"
                )
            schedule = schedules.build(
                spec,
                graph.num_stages,
                self.num_microbatches,
                num_devices=self.num_devices,
                costs=costs,
                mem_limit=self.mem_limit,
                w_mem=self.w_mem,
                **options,
            )
        self._check_schedule(schedule, graph, kind)
        return schedule

    def _check_schedule(
        self, schedule: Schedule, graph: StageGraph | None = None, kind: str = "chain"
    ) -> None:
        if schedule.num_devices != self.num_devices:
            per_device = schedule.num_stages // max(schedule.num_devices, 1)
            raise ScheduleError(
                f"schedule {schedule.name!r} runs on {schedule.num_devices} devices but mesh "
                f"axis {self.axis_name!r} has {self.num_devices}; build the schedule for "
                f"{self.num_devices} devices"
                + (
                    f" (a schedule of {per_device} stages per device: num_stages="
                    f"{per_device * self.num_devices})"
                    if per_device > 1 and schedule.num_stages % schedule.num_devices == 0
                    else f" (num_devices={self.num_devices})"
                )
            )
        if schedule.num_microbatches != self.num_microbatches:
            raise ScheduleError(
                f"schedule {schedule.name!r} has {schedule.num_microbatches} microbatches but "
                f"the pipeline splits the batch into num_microbatches={self.num_microbatches}; "
                f"pass num_microbatches={schedule.num_microbatches} to zbjax.pipeline, or build "
                f"the schedule for {self.num_microbatches}"
            )
        if graph is not None and schedule.num_stages != graph.num_stages:
            # Only a cut by cost takes a stage count; markers (and GraphPipe) decide their own.
            markers = schedule.num_stages - 1
            made, other = {
                "markers": (
                    "the model's stage_boundary markers make",
                    f"or place {markers} stage_boundary marker{'s' * (markers != 1)}",
                ),
                "graph": (
                    "partitioner='graph' cut the model into",
                    f"or use partitioner='chain' with num_stages={schedule.num_stages}",
                ),
            }.get(
                kind,
                (
                    "the model was cut into",
                    f"or pass num_stages={schedule.num_stages} to zbjax.pipeline",
                ),
            )
            raise ScheduleError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages but {made} "
                f"{graph.num_stages}; build the schedule with num_stages={graph.num_stages} "
                f"{other}"
            )
        if graph is not None:
            # The schedule orders actions by its own edges: each of the model's must be among
            # them (or follow from them), else an action could run before the one it reads.
            reach = {s: {s} for s in range(schedule.num_stages)}
            for s in reversed(topological_order(schedule.num_stages, schedule.edges)):
                for t in schedule.successors(s):
                    reach[s] |= reach[t]
            unordered = [(a, b) for a, b in graph.edge_pairs if b not in reach[a]]
            if unordered:
                raise ScheduleError(
                    f"schedule {schedule.name!r} has stage edges {list(schedule.edges)}, which "
                    f"do not order the model's stage edges {unordered} (the model's stage "
                    f"graph: {list(graph.edge_pairs)}), so a stage could run before the one it "
                    f"reads; build the schedule with edges={list(graph.edge_pairs)} (e.g. "
                    "pipe.graph.edge_pairs)"
                )

    def _step_fn(self, low: Lowering, graph: StageGraph, with_key: bool, training: bool = False):
        """Returns the step over ``low`` (params, batch, key, pools) -> (loss, grads, pools).
        A ``training`` step whose stages call a ``jax.custom_vjp`` function refuses to be
        differentiated (``_no_outer_derivative``)."""
        m = self.num_microbatches
        treedef = self._params_treedef
        refuse = training and graph.holds_custom_vjp

        def step(params, batch, key, pools):
            staged_input = isinstance(params, StagedParams)
            # Rows and the batch keep their sharding on this mesh; leaves are joined into rows.
            params = _replicated(params, self.mesh, own=not staged_input)
            batch = _replicated(batch, self.mesh, own=False)
            staged = params if staged_input else stage_leaves(low.layout, jax.tree.leaves(params))
            if self.tensor_axis is not None and not staged_input:
                # Each device builds only its blocks of the rows it holds.
                # (A constraint names Auto axes only; an Explicit pp axis is placed by the
                # lowering's reshard.)
                types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
                auto = types[self.axis_name] == jax.sharding.AxisType.Auto
                spec = PartitionSpec(self.axis_name if auto else None, self.tensor_axis)
                where = NamedSharding(self.mesh, spec)
                staged = jax.tree.map(lambda r: jax.lax.with_sharding_constraint(r, where), staged)
            stacked = split_microbatches(batch, m)
            if with_key:
                stacked = (stacked, microbatch_keys(key, m))
            leaves = jax.tree.leaves(stacked)
            if pools is None:
                (loss, grads), pools = low.step(staged, leaves), None
            else:
                loss, grads, pools = low.step(staged, leaves, pools)
            if refuse:
                inexact = lambda t: jnp.issubdtype(t.dtype, jnp.inexact)  # noqa: E731
                loss = jax.tree.map(lambda t: _no_outer_derivative(t) if inexact(t) else t, loss)
            if staged_input:
                # Each device keeps its rows (every copy of a tied leaf holds the summed
                # gradient, so an optimizer applied in the staged layout keeps copies equal).
                return loss, grads, pools
            grad_leaves = unstage_leaves(low.layout, _replicated(grads, self.mesh))
            return loss, jax.tree_util.tree_unflatten(treedef, grad_leaves), pools

        return step


def _params_mismatch(pipe: Pipeline, treedef: Any, paths: tuple, avals: tuple) -> str:
    """Returns the error for params unlike those ``pipe`` was traced with, naming the leaves
    that differ (a model's tree holds hundreds: the whole of both is no help; helper H2)."""
    fix = "pass params of the same tree, shapes and dtypes, or build a new zbjax.pipeline"
    want_paths, want_avals = pipe._params_paths, pipe._params_avals
    if treedef == pipe._params_treedef:
        differ = [
            (path, want, got)
            for path, want, got in zip(paths, want_avals, avals, strict=True)
            if _strong((want,)) != _strong((got,))
        ]
        listed = "; ".join(
            f"{path or 'the params'} is {_shapes_text([got])}, traced as {_shapes_text([want])}"
            for path, want, got in differ[:3]
        )
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        return (
            f"params differ from those this pipeline was traced with in {len(differ)} "
            f"lea{'ves' if len(differ) != 1 else 'f'}: {listed}{more}; {fix}"
        )
    missing = [p for p in want_paths if p not in set(paths)]
    extra = [p for p in paths if p not in set(want_paths)]
    if not missing and not extra:
        return (
            "params have the leaves this pipeline was traced with, in another tree (container "
            f"types or order): traced {str(pipe._params_treedef)[:300]}, given "
            f"{str(treedef)[:300]}; {fix}"
        )
    parts = [
        f"{label} {', '.join(found[:3])}" + (f" (and {len(found) - 3} more)" * (len(found) > 3))
        for label, found in (("missing", missing), ("not traced", extra))
        if found
    ]
    return (
        f"params have another tree than this pipeline was traced with ({len(want_paths)} leaves "
        f"then, {len(paths)} now): {'; '.join(parts)}; {fix}"
    )


class StagedLayoutError(PipelineError):
    """Staged params given with inputs whose automatic cut holds other params per stage (a
    call without the key training takes: no dropout equations)."""


@jax.custom_jvp
def _no_outer_derivative(x: jax.Array) -> jax.Array:
    """The identity, whose derivative raises: put on the training step's loss (and aux) where
    a stage calls a ``jax.custom_vjp`` function. The step's forwards run jax.vjp's forward, in
    which such a function is its fwd rule's body, so JAX differentiating the step would
    differentiate that body and not the user's bwd rule (helper H1)."""
    return x


@_no_outer_derivative.defjvp
def _no_outer_derivative_jvp(primals: Any, tangents: Any) -> Any:
    raise PipelineError(
        "differentiating pipe.value_and_grad's outputs (jax.grad of its loss, or of its grads) "
        "is not supported when loss_fn calls a jax.custom_vjp function: the training step "
        "runs the function's fwd rule, so JAX would differentiate that and not your bwd rule. "
        "Differentiate pipe.value(params, batch) instead (it runs the custom_vjp function "
        "itself), or use the grads value_and_grad returns"
    )


def _new_buffers(built: _Built) -> Buffers:
    return Buffers(tuple(built.lowering.new_pools()))


def _traced(tree: Any) -> bool:
    """Returns whether the call is inside a user's trace: a leaf of ``tree`` is a tracer, or
    JAX is tracing (a jit, eval_shape or cond branch that closes over concrete inputs)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)) or under_trace()


def _widened(staged: str, now: Any) -> bool:
    """Returns whether a row staged as ``staged`` may hold dtype ``now`` as updates: float32
    for a 16-bit float, any float for an integer or bool (optax's updates of such leaves)."""
    if dtype_name(now) == dtype_name(wide_dtype(staged)):
        return True
    return not jnp.issubdtype(staged, jnp.inexact) and jnp.issubdtype(now, jnp.floating)


def _global_norm(layouts: tuple, values: list) -> jax.Array:
    """Returns the L2 norm of ``values``: staged rows counted through their layout (each
    element once), other arrays as they are (integer and bool leaves too, as optax counts)."""
    squares = [
        sum_of_squares(x) if layout is None else staged_sum_of_squares(layout, x)
        for layout, x in zip(layouts, values, strict=True)
    ]
    return jnp.sqrt(sum(squares, jnp.float32(0.0)))


def _this_process(x: Any) -> Any:
    """Returns ``x``, or for an array over other processes' devices a host array of its shape
    holding what this process's devices hold (zeros elsewhere): the stage programs
    ``measure_costs`` times run on one device of this process, and time the same on any
    values."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.is_fully_addressable:
        return x
    if x.sharding.is_fully_replicated:
        return x.addressable_data(0)  # on one of this process's devices (PRNG keys too)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _this_process(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    out = np.zeros(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def _fits_mesh(x: Any, mesh: Any) -> bool:
    """Returns whether a program on ``mesh`` takes ``x`` as it is: no array, an uncommitted
    one, or one laid out on ``mesh`` itself (not another mesh, nor its devices in another
    order)."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
        return True
    return isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh


def _spread(x: Any) -> bool:
    """Returns whether ``x`` is a concrete array sharded over several devices."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    return len(x.sharding.device_set) > 1


def _on_one_device_set(leaves: list) -> list:
    """Returns ``leaves``, or where concrete arrays among them are committed to different
    devices (a checkpoint restored leaf by leaf onto the devices of its stages), all of them
    on the first one's, which JAX needs to join them into rows (nothing else is moved)."""
    arrays = [x for x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
    if len({frozenset(x.devices()) for x in arrays if x.committed}) <= 1:
        return leaves
    target = min(arrays[0].devices(), key=lambda d: d.id)
    moved = {id(x) for x in arrays}
    return [jax.device_put(x, target) if id(x) in moved else x for x in leaves]


def _replicated(tree: Any, mesh: Any, own: bool = True) -> Any:
    """Returns ``tree`` with its arrays sharded over the Explicit axes of a mesh replicated
    on that mesh: those of a mesh other than ``mesh`` (a sharded init on
    ``jax.make_mesh((4,), ("data",))`` of the same devices), as the step's ``shard_map`` over
    ``mesh`` knows only its own axes, and with ``own`` those of ``mesh`` too (staged rows or
    user-layout param leaves, a sharded init, a restored checkpoint), as rows are sliced and
    leaves flattened and joined next, which JAX does not do to arrays sharded over explicit
    axes."""

    def replicate(x: Any) -> Any:
        sharding = getattr(jax.typeof(x), "sharding", None) if _is_array(x) else None
        if sharding is None or not any(s is not None for s in sharding.spec):
            return x
        if sharding.mesh == mesh.abstract_mesh:
            return jax.reshard(x, NamedSharding(mesh, PartitionSpec())) if own else x
        concrete = x.sharding.mesh if not isinstance(x, jax.core.Tracer) else sharding.mesh
        return jax.reshard(x, NamedSharding(concrete, PartitionSpec()))

    return jax.tree.map(replicate, tree)


def _refuse_traced(method: str, **trees: Any) -> None:
    """Raises PipelineError when an input is traced (``pipe.{method}`` called inside
    ``jax.jit`` or another transform): the method runs and times the step itself."""
    if _traced(trees):
        raise PipelineError(
            f"pipe.{method} runs and times the compiled step itself, so it needs concrete "
            "arrays, and got traced ones (it was called inside jax.jit or another "
            "transform); call it outside, on the values"
        )


def _refuse_shapes(method: str, **trees: Any) -> None:
    """Raises PipelineError naming an input given as ``jax.ShapeDtypeStruct``: shapes build a
    pipeline (``pipe.lower``, ``pipe.stage``), a step needs values."""
    for name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise PipelineError(
                    f"{name} leaf {jax.tree_util.keystr(path) or '(the whole ' + name + ')'} is "
                    f"a jax.ShapeDtypeStruct: pipe.{method} runs the step and needs values; "
                    "shapes go to pipe.lower or pipe.stage (a restore target: restore the "
                    "rows into it first)"
                )


def _warn_host_residuals(programs: Sequence[StageProgram]) -> None:
    """Warns when a ``jax.checkpoint`` offload policy puts residuals in host memory: the
    step keeps residuals in its arenas, in device memory."""
    offloaded = [
        (p.stage.index, aval)
        for p in programs
        for aval in (
            *p.forward.out_avals[len(p.stage.jaxpr.out_avals) :],  # residuals
            *p.backward_input.out_avals[len(p.backward_input.out_avals) - len(p.stash_avals) :],
        )
        if in_host_memory(aval)
    ]
    if offloaded:
        nbytes = sum(cost_model.aval_bytes(aval) for _, aval in offloaded)
        warnings.warn(
            f"a jax.checkpoint offload policy puts {len(offloaded)} residuals of stages "
            f"{sorted({s for s, _ in offloaded})} ({nbytes:,} bytes per microbatch) in host "
            "memory, but the pipelined step keeps every residual in its arenas in device "
            "memory, so they stay on the device (the results are the same); offloading is "
            "not supported inside a pipeline: use a policy that saves or recomputes them",
            stacklevel=caller_stacklevel(),
        )


def _stage_params(graph: StageGraph) -> tuple:
    """Returns which param leaves (and rows of them) each stage holds: the staged layout."""
    return tuple((s.param_leaves, s.param_rows) for s in graph.stages)


def _off_explicit_mesh(tree: Any) -> Any:
    """Returns ``tree`` with each concrete array whose type names a mesh of explicit axes
    replaced by its value as a NumPy array (a PRNG key array: rewrapped key data)."""

    def off(x: Any) -> Any:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if not any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return np.asarray(x)

    return jax.tree.map(off, tree)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.core.Tracer)


def _arena_text(low: Lowering) -> str:
    """Returns the bytes of the step's arenas (``zbjax.ticks.arenas``) as the report says them."""
    sizes = low.arena_bytes()
    overlaid = (
        " (B writes W's stash over the residuals only it read)"
        if any(s.overlay for s in low.slot_layouts)
        else ""
    )
    if low.arenas.shared:
        return f"{sizes[0]:,} B in one arena for residuals, kept residuals and W's stash{overlaid}"
    res, kept, stash = sizes
    return (
        f"{sum(sizes):,} B in arenas: residuals {res:,} B, kept until W {kept:,} B, "
        f"W stash {stash:,} B{overlaid}"
    )


def _predicted_step(graph: StageGraph, num_microbatches: int) -> float:
    """Returns GraphPipe's step model on a stage graph's forward costs, each stage on its own
    device: one microbatch's longest path through the stages plus m - 1 times the largest."""
    times = [stage.cost for stage in graph.stages]  # stages are numbered in topological order
    return graphpipe.dag_step_estimate(times, graph.edge_pairs, num_microbatches)


def _stage_dag_lines(graph: StageGraph, schedule: Schedule, partitioner: str) -> list[str]:
    """Returns report lines on the stage graph's edges, branches and placement (DAGs only)."""
    pairs = graph.edge_pairs
    if pairs == schedules.chain_edges(graph.num_stages):
        return []
    preds: dict[int, list[int]] = {}
    succs: dict[int, list[int]] = {}
    for a, b in pairs:
        preds.setdefault(b, []).append(a)
        succs.setdefault(a, []).append(b)
    fan_in = [f"{s} <- {sorted(p)}" for s, p in sorted(preds.items()) if len(p) > 1]
    fan_out = [f"{s} -> {sorted(d)}" for s, d in sorted(succs.items()) if len(d) > 1]
    sources = [s for s in range(graph.num_stages) if s not in preds]
    return [
        "",
        f"stage graph ({partitioner} partition): edges " + ", ".join(f"{a}->{b}" for a, b in pairs),
        f"  sources (branches start): {sources}; fan-in: {', '.join(fan_in) or '-'}; "
        f"fan-out: {', '.join(fan_out) or '-'}",
        "  placement (stage -> device): "
        + ", ".join(f"{s}->{d}" for s, d in enumerate(schedule.placement)),
    ]


def _measured_cost_lines(costs: schedules.Costs | None, num_stages: int) -> list[str]:
    """Returns the report's lines of the costs a pipeline was planned with (``costs=``), one
    per stage: F, B, W and the fused backward, in the costs' unit (seconds when measured)."""
    if costs is None:
        return []
    f, b, w = costs.per_stage(num_stages)
    bw = costs.fused_per_stage(num_stages)
    lines = ["costs it was planned with (costs=; seconds when measured), per stage:"]
    lines += [
        f"stage {s}: F {f[s]:.4g}, B {b[s]:.4g}, W {w[s]:.4g}, fused backward {bw[s]:.4g}"
        + (f" ({bw[s] / (b[s] + w[s]):.3f} of B + W)" if b[s] + w[s] > 0 else "")
        for s in range(num_stages)
    ]
    lines.append(f"exchange: {costs.comm:.4g}, each further message {costs.comm_message:.4g}")
    return lines


class _PeerFailed(PipelineError):
    """Another process stopped building this pipeline (its error is in the message)."""


def _exchanged(value: Any) -> list[Any] | None:
    """Returns every process's ``value`` (picklable; process i's at index i), or None without
    jax.distributed. Raises _PeerFailed where another process posted its build's failure
    (``_post_failure``) instead."""
    every = exchange_between_processes(pickle.dumps(("ok", value)))
    if every is None:
        return None
    parts = [pickle.loads(b) for b in every]
    failed = [(i, part[1]) for i, part in enumerate(parts) if part[0] == "failed"]
    if failed:
        i, message = failed[0]
        raise _PeerFailed(
            f"process {i} stopped building this pipeline ({message}); every process builds it "
            "from the same arguments and shapes, so fix that process's call"
        )
    return [part[1] for part in parts]


def _post_failure(err: BaseException) -> None:
    """Tells the other processes, waiting at this build's next exchange, that this one stopped
    with ``err`` (so that they raise at once instead of waiting there for it)."""
    message = f"{type(err).__name__}: {err}"[:500]
    exchange_between_processes(pickle.dumps(("failed", message)), wait=False)


def _agree_on_call(params: Any, batch: Any, key: Any) -> None:
    """Raises PipelineError in every process when the processes called the pipeline with
    inputs of other trees, shapes or dtypes. Each eager call checks: a process whose call
    differs only from the second step on (another batch shape) would build anew while the
    others run the step they built, and wait in its exchanges."""

    # (A failure here, before the exchange, is posted by the calling method's _agreeing.)
    text = repr(
        (
            ("staged rows", params.layout, _tree_text(params.rows))
            if isinstance(params, StagedParams)
            else _tree_text(params),
            _tree_text(batch),
            None if key is None else _tree_text(key),
        )
    )
    _refuse_different(
        _exchanged(hashlib.sha256(text.encode()).digest()),
        "called this pipeline with different inputs",
        "another params tree, staged or not, or another batch tree, shape or dtype, or a key "
        "where another has none",
        "every process must pass inputs of the same trees and shapes at every call",
    )


def _tree_text(tree: Any) -> list[tuple[str, str]]:
    """Returns each leaf of ``tree`` as (its key path, dtype and shape): the same in every
    process for alike trees (a treedef's repr may hold a static field's memory address)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        (jax.tree_util.keystr(path), f"{getattr(x, 'dtype', type(x).__name__)}{list(np.shape(x))}")
        for path, x in leaves
    ]


def _from_first_process(value: Any) -> Any:
    """Returns process 0's ``value`` (a picklable plan: costs, a schedule) in every process."""
    every = _exchanged(value)
    return value if every is None else every[0]


def _check_same_program(graph: StageGraph, schedule: Schedule, micro: Any, layout: Any) -> None:
    """Raises PipelineError in every process when the processes built different pipelines
    (another model, params tree, stage count or batch shape): their step programs would not
    match, and the first exchange would fail inside the collectives or hang. ``layout`` is
    the staged layout's fingerprint and the params' leaves (paths, shapes and dtypes)."""
    text = repr((stage_summary(graph), schedule, jax.tree.leaves(micro), layout))
    _refuse_different(_exchanged(hashlib.sha256(text.encode()).digest()))


def _refuse_different(
    every: list[Any] | None,
    did: str = "built different pipelines",
    differences: str = "another model, params tree, schedule, stage count, microbatch count "
    "or batch shape",
    fix: str = "every process must call zbjax.pipeline with the same arguments and pass params "
    "and batches of the same trees and shapes",
) -> None:
    """Raises PipelineError when another process's part of an exchange differs from process
    0's (what each asked for, a digest of what each built or was called with)."""
    differ = [i for i, part in enumerate(every or ()) if part != every[0]]
    if differ:
        raise PipelineError(
            f"the processes {did} (process{'es' if len(differ) > 1 else ''} "
            f"{', '.join(map(str, differ))} not as process 0: {differences}); {fix}"
        )


def program_costs(programs: tuple[StageProgram, ...]) -> Costs:
    """Returns per-stage F/B/W costs from the stage programs' estimates."""
    return Costs(
        f=tuple(p.cost_forward for p in programs),
        b=tuple(p.cost_backward_input for p in programs),
        w=tuple(p.cost_backward_weight for p in programs),
    )


def pipeline(
    loss_fn: Callable[..., Any],
    *,
    mesh: Any,
    axis_name: str = "pp",
    schedule: str | Schedule = "zb-h1",
    num_microbatches: int = 8,
    num_stages: int | None = None,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    w_mem: float | None = None,
    partitioner: str = "auto",
    placement: Sequence[int] | None = None,
    keep_buffers: bool | None = None,
    pack_ticks: bool | None = None,
    has_aux: bool = False,
    param_specs: Any = None,
) -> Pipeline:
    """Returns a ``Pipeline`` whose ``value_and_grad`` runs ``loss_fn`` pipelined over a mesh axis.

    ``loss_fn(params, batch)`` (``loss_fn(params, batch, key)`` for calls given a ``key``)
    returns the mean loss over its batch; the pipeline calls it on one microbatch at a time.
    ``mesh`` (a ``jax.sharding.Mesh``, e.g. ``jax.make_mesh``) holds the devices; its axis
    ``axis_name`` (default ``"pp"``) is the pipeline axis, other axes are data parallel (or the
    ``param_specs`` tensor axis). ``num_microbatches`` (default 8) is how many microbatches
    each batch is split into along axis 0; ``num_stages`` (default: one per pp device, two for
    zb-v and interleaved-1f1b) how many stages an unmarked model is cut into.

    ``has_aux``: ``loss_fn`` returns ``(loss, aux)``, aux a pytree of arrays (metrics,
    say); ``value_and_grad`` then returns ``((loss, aux), grads)``, each aux leaf the mean of
    its per-microbatch values, as the loss is (floating leaves), or, where its first axis
    follows the batch's rows (the shape alone decides: predictions, a per-row loss; any
    dtype), the microbatches' values joined in row order, as ``reference_value_and_grad``
    computes them. Aux is computed where
    ``loss_fn`` computes it and carried to the last stage.

    ``param_specs``: tensor parallelism inside each stage. A ``PartitionSpec`` per param leaf
    (a pytree matching the params, or a prefix of it; None for a replicated leaf) naming one
    mesh axis, the tensor-parallel axis, which must be an Auto axis: e.g. ``P(None, "tp")`` for
    a column-parallel kernel, ``P("tp", None)`` for a row-parallel one. Each leaf is stored
    split as its spec says (``pipe.stage`` places each device's part on it) and XLA partitions
    each stage's equations over the axis. The other non-pipeline axes stay data parallel.

    ``schedule`` is a name (``zbjax.schedules.SCHEDULE_NAMES`` or, for graph pipelines,
    ``DAG_SCHEDULE_NAMES``: ``"dag-1f1b"``, ``"dag-zb"``) or a prebuilt ``Schedule``;
    ``costs``, ``mem_limit`` and ``w_mem`` go to ``schedules.build`` (zb-auto and the DAG
    schedules take their costs from the stage programs' estimates when ``costs`` is None).
    The costs also decide which W actions ``pack_ticks`` packs; over several processes every
    process plans with process 0's ``costs`` and ``pack_ticks``, so that all build the same
    program.

    ``partitioner`` cuts the program into stages:

    - ``"auto"`` (default): at the ``stage_boundary`` markers when ``loss_fn`` has any; else
      ``"graph"`` for ``dag-1f1b``/``dag-zb`` by name (unless ``num_stages`` is given), except
      where GraphPipe, which keeps a scan over layers whole, leaves a device without a stage
      or one stage above 1.5 times an even share and the chain cut's step is predicted 10 %
      shorter (then ``"chain"``: ``pipe.partitioner_used`` says which); else ``"chain"``;
    - ``"markers"``: at the markers (an error when there are none);
    - ``"chain"``: ``num_stages`` contiguous stages balanced by the cost model (default: one per
      device, two for zb-v and interleaved-1f1b); an error when ``loss_fn`` has markers;
    - ``"graph"``: GraphPipe (``zbjax.graphpipe``) on the traced program: an operator graph
      (``op_graph_from_jaxpr``), cut by ``graph_partition`` into a stage DAG with at most one
      stage per pp device (parallel branches become parallel stages) minimising the predicted
      step time; the stages run where its placement says. With markers it cuts only at
      them (and where branches part); the stage count is its choice, so ``num_stages`` must
      be None.

    ``placement`` (DAG schedules by name only) gives the device of each stage, e.g. to run a
    marker graph with more stages than devices; without it, the stage count must equal the pp
    axis size unless the graph partitioner placed the stages.

    ``keep_buffers``: keep the step's residual and stash slots allocated between
    ``value_and_grad`` calls (each call donates them to the next) instead of allocating them in
    every step. Default: on CPU meshes, where XLA fills fresh slots with zeros (a memory pass
    per step); off elsewhere, where allocating them costs nothing and the memory is better left
    free between steps (for the optimizer's update). The slots of the latest batch shape are
    kept (a call with another shape frees them). It applies to calls with concrete arrays;
    inside a user's ``jax.jit`` the step allocates its slots itself unless given them:
    ``pipe.init_buffers`` and ``value_and_grad(..., buffers=)``.

    ``pack_ticks``: the compiled step advances all devices tick by tick, each tick as long as
    its slowest action; when packing, a device that would finish early also runs its next
    actions that fit in the rest of the tick (W, and F, B or BW whose inputs arrived at an
    earlier tick), judged by ``costs``, if that shortens the predicted step; where every
    edge of the stage graph crosses between devices, the ticks may instead be laid out
    around the fewest, best-placed exchanges (``ticks.segment_ticks``) where that
    predicts a shorter step; and a stage whose B computes nothing (no differentiable input,
    like the first), or whose B and W cost more than its fused backward (``costs.bw``), runs
    its backward fused where B stood if that does (``pipe.schedule`` is then the fused
    schedule).
    None (default): pack when ``costs`` is given (times you measured, e.g. each stage's F, B
    and W jitted alone); True: pack by ``costs`` or, without them, by the stage programs'
    static estimates (FLOPs plus bytes moved; rough on small stages); False: one action per
    device per tick.
    """
    return Pipeline(
        loss_fn,
        mesh=mesh,
        axis_name=axis_name,
        schedule=schedule,
        num_microbatches=num_microbatches,
        num_stages=num_stages,
        costs=costs,
        mem_limit=mem_limit,
        w_mem=w_mem,
        partitioner=partitioner,
        placement=placement,
        keep_buffers=keep_buffers,
        pack_ticks=pack_ticks,
        has_aux=has_aux,
        param_specs=param_specs,
    )
