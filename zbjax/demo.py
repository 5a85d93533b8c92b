"""``zbjax demo``: train the reference GPT pipelined over a device mesh, and check it.

``run_demo(DemoConfig(...))`` trains ``models.gpt`` on a character-level corpus that
``zbjax.data`` generates at run time, with ``zbjax.pipeline`` over a 1-D ``pp`` mesh and
``optax.adamw`` (weight decay on matrices), and returns a ``DemoResult``: the loss curve, step
times, the first step compared with ``jax.value_and_grad(loss_fn)``, the final loss
compared with an unpipelined run of the same steps (same batches, same optimizer), and the
loss on held-out text (``pipe.value``, the forwards alone) before and after training, the
latter against ``loss_fn`` unpipelined on the trained params. The command
line (``zbjax.cli``) only prints what the callbacks and the result say.

Choices a user would want to know:

- The model is cut with ``stage_boundary`` markers at ``balanced_boundaries(cfg, num_stages)``
  (embedding with the first block, the final LayerNorm and tied head with the last). The Gantt
  chart, the trace, the bubble rate on the progress line and the report all show the schedule
  that actually runs (``pipe.schedule``), simulated with the same costs: the stage programs'
  own estimates (``zbjax.pipeline.program_costs``). The trace, which Perfetto reads in
  microseconds, has them scaled so that the simulated step lasts the measured median step.
- Left to choose the devices, the demo takes only as many as the layers give stages to (4 of
  8 for zb-v and interleaved-1f1b with the 8 default layers) and says so in the report.
- Params stay in the pipeline's staged layout between steps (``pipe.stage``). adamw decays the
  weight matrices and embeddings only (a mask on the parameter tree, as GPT recipes do: no
  decay on LayerNorm scales and biases), so it runs through ``pipe.per_leaf``: each device
  updates the leaves its stages hold, in the tree's structure, which equals adamw on the user
  layout (a tied leaf's copies all receive the summed gradient); padding stays zero.
- On CPU the demo asks JAX for 8 host devices (more when ``devices`` is larger) before the
  backend starts; when the backend is already running (in tests) it uses the devices present.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import jax
import numpy as np

from zbjax import schedules
from zbjax.cpu import use_cpu_devices
from zbjax.data import CharTokenizer, batch_at, synthetic_text
from zbjax.errors import PipelineError
from zbjax.pipeline import TWO_STAGES_PER_DEVICE, program_costs
from zbjax.pipeline import pipeline as make_pipeline
from zbjax.trace import ActionTimes, action_times, make_output_dir

if TYPE_CHECKING:  # optax is imported where it is used: building the CLI parser stays fast
    import optax

#: Host devices the demo asks for on CPU when ``devices`` is not larger.
CPU_DEVICES = 8

#: First-step check: |loss - ref| <= LOSS_RTOL * |ref|, and for every leaf
#: max|grad - ref| <= GRAD_ATOL + GRAD_RTOL * max|ref|.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6
#: Embeddings start at this multiple of ``models.gpt``'s init (see ``rescale_init``).
EMBEDDING_INIT_SCALE = 3.0
#: Final check: the last step's loss of both runs agree to this relative tolerance.
FINAL_RTOL = 1e-4
#: The final params may differ from the unpipelined run's by this fraction of the largest
#: change the unpipelined training made to any parameter (Adam's step sizes follow the sign
#: of tiny gradients, so a float-level difference can move a parameter by a step).
FINAL_PARAM_RTOL = 0.02


@dataclass(frozen=True)
class DemoConfig:
    """What to train and how; defaults finish in about a minute on a 2-core CPU."""

    schedule: str = "zb-h1"
    devices: int | None = None  # pp size; None: every device present, at most 8, over tp
    tp: int = 1  # tensor-parallel devices per pipeline device (param_specs): pp x tp in all
    stages: int | None = None  # None: devices, or 2 x devices for zb-v / interleaved-1f1b
    microbatches: int = 8
    layers: int = 8
    width: int = 64
    heads: int = 4
    steps: int = 60
    batch_size: int = 32
    seq_len: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    corpus_chars: int = 32_768
    out_dir: str | None = "zbjax-demo"  # Gantt PNG and schedule trace; None: write nothing
    profile_dir: str | None = None  # jax.profiler trace of two steps after the first
    check_final: bool = True  # also train unpipelined and compare the final loss


@dataclass(frozen=True)
class StepInfo:
    """One finished training step, as the progress display shows it."""

    step: int  # 0-based
    num_steps: int
    loss: float
    seconds: float  # wall time of this step (the first includes compiling the adamw update)
    tokens_per_second: float
    bubble_rate: float


@dataclass(frozen=True)
class FirstStepCheck:
    """The first step's loss and grads against ``jax.value_and_grad(loss_fn)`` unpipelined."""

    loss: float
    reference_loss: float
    loss_rel_diff: float
    grad_max_abs_diff: float
    grad_max_rel_diff: float  # max over leaves of max|g - ref| / max|ref|
    worst_leaf: str
    passed: bool


@dataclass(frozen=True)
class FinalCheck:
    """The pipelined run's last loss and params against an unpipelined run of the same steps."""

    loss: float
    reference_loss: float
    loss_rel_diff: float
    param_max_abs_diff: float
    reference_losses: tuple[float, ...]
    passed: bool
    #: The largest change the unpipelined run made to any parameter, the scale that
    #: ``param_max_abs_diff`` is judged against (``FINAL_PARAM_RTOL``).
    reference_param_change: float = 0.0


@dataclass(frozen=True)
class HeldOutCheck:
    """The loss on held-out text (``pipe.value``, forwards only) before and after training,
    and after it against ``loss_fn`` unpipelined on the same params."""

    before: float
    after: float
    reference: float
    rel_diff: float
    passed: bool


@dataclass(frozen=True)
class DemoResult:
    """What ``run_demo`` measured: losses, timings, checks, and the files it wrote."""

    config: DemoConfig
    num_devices: int
    num_stages: int
    num_params: int
    losses: tuple[float, ...]
    step_seconds: tuple[float, ...]
    tokens_per_step: int
    bubble_rate: float
    first_step: FirstStepCheck
    final: FinalCheck | None
    files: tuple[str, ...]
    notes: tuple[str, ...]
    phase_seconds: tuple[tuple[str, float], ...]  # where the wall time went
    wall_seconds: float
    action_times: ActionTimes | None = None  # per action and device, from the profiled steps
    held_out: HeldOutCheck | None = None

    @property
    def loss_decreased(self) -> bool:
        """Returns whether the last step's loss is below the first's."""
        return self.losses[-1] < self.losses[0]

    @property
    def diverged(self) -> bool:
        """Returns whether a step's loss was not finite (NaN or infinite)."""
        return not all(math.isfinite(x) for x in self.losses)

    @property
    def passed(self) -> bool:
        """Returns whether the first-step, held-out and (when run) final checks passed."""
        return (
            self.first_step.passed
            and (self.final is None or self.final.passed)
            and (self.held_out is None or self.held_out.passed)
        )


def request_cpu_devices(num_devices: int | None) -> bool:
    """Returns whether JAX will start with ``max(8, num_devices)`` CPU devices.

    Must run before the first JAX computation: afterwards the device count is fixed and this
    returns False, leaving the devices as they are. It changes only the CPU backend, so it is
    harmless where accelerators are present.
    """
    return use_cpu_devices(max(CPU_DEVICES, num_devices or 0))


def _check_config(config: DemoConfig) -> None:
    names = schedules.SCHEDULE_NAMES + schedules.DAG_SCHEDULE_NAMES
    if config.schedule not in names:
        raise PipelineError(
            f"schedule={config.schedule!r} is not a schedule; choose one of {', '.join(names)}"
        )
    positive = ("microbatches", "layers", "width", "heads", "steps", "batch_size", "seq_len")
    for name in positive:
        value = getattr(config, name)
        if value < 1:
            raise PipelineError(f"{name}={value}; it must be at least 1")
    for name in ("devices", "stages", "tp"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise PipelineError(f"{name}={value}; it must be at least 1")
    if config.width % config.heads:
        raise PipelineError(
            f"width={config.width} is not divisible by heads={config.heads}; choose a width "
            f"that is a multiple of {config.heads} or fewer heads"
        )
    if config.batch_size % config.microbatches:
        raise PipelineError(
            f"batch_size={config.batch_size} is not divisible by "
            f"microbatches={config.microbatches}; use a batch size that is a multiple of "
            f"{config.microbatches}"
        )
    if not 0 < config.lr < math.inf:
        raise PipelineError(f"lr={config.lr}; the learning rate must be finite and > 0")
    if not 0 <= config.seed < 2**63:  # jax.random.key takes a signed 64-bit seed
        raise PipelineError(f"seed={config.seed}; it must be >= 0 and below 2**63")
    if config.tp > 1 and (config.heads % config.tp or (4 * config.width) % config.tp):
        # Otherwise the attention and MLPs of every stage would stay replicated over the tp
        # devices (models.gpt.tensor_parallel_specs leaves what it cannot split whole).
        raise PipelineError(
            f"tp={config.tp} must divide heads={config.heads} (attention is split by whole "
            f"heads) and the MLP's {4 * config.width} hidden features; choose a tp that "
            "divides both"
        )


def _stages_per_device(schedule: str) -> int:
    return 2 if schedule in TWO_STAGES_PER_DEVICE else 1


def _stages_and_placement(
    config: DemoConfig, num_devices: int
) -> tuple[int, tuple[int, ...] | None]:
    """Returns the model's stage count on ``num_devices`` pipeline devices and, for the DAG
    schedules given more stages than devices, their placement (contiguous blocks of stages
    per device); raises PipelineError for a stage count the schedule cannot run."""
    per_device = _stages_per_device(config.schedule)
    fixed = num_devices * per_device
    if config.stages is None or config.stages == fixed:
        return fixed, None
    if config.schedule in schedules.DAG_SCHEDULE_NAMES:
        if config.stages > num_devices:
            return config.stages, tuple(
                s * num_devices // config.stages for s in range(config.stages)
            )
        # The message names the schedule's own rule: it takes more stages, not another schedule.
        raise PipelineError(
            f"stages={config.stages}: {config.schedule} runs at least one stage per device, "
            f"so at least {num_devices} stages on {num_devices} pipeline devices (more are "
            f"placed in contiguous blocks); leave stages out, use --stages {num_devices} or "
            f"more, or --devices {config.stages}"
        )
    several = f"{per_device} stages per device" if per_device > 1 else "one stage per device"
    if config.stages % per_device:
        devices_hint = "use an even --stages, or leave stages out and set --devices"
    else:
        devices_hint = f"leave stages out and use --devices {config.stages // per_device}"
    more = (
        "; or, for more stages than that, dag-1f1b or dag-zb, which place them in blocks"
        if config.stages > fixed
        else ""
    )
    raise PipelineError(
        f"stages={config.stages}: {config.schedule} runs {several}, so {fixed} stages on "
        f"{num_devices} pipeline devices; {devices_hint}{more}"
    )


def _make_dirs(config: DemoConfig) -> None:
    """Makes the output and profile directories before training, or raises PipelineError
    naming the one that cannot be made."""
    for name, path in (("out_dir", config.out_dir), ("profile_dir", config.profile_dir)):
        if path is not None:
            make_output_dir(name, path)


def _default_devices(config: DemoConfig) -> tuple[int | None, str | None]:
    """Returns the pipeline devices to ask ``_pp_mesh`` for, and a note saying why when the
    demo chose fewer than the devices present: left to itself, the demo takes only as many as
    the layers can give stages to (zb-v's 2 stages per device on all 8 devices would need 15
    layers, not the default 8)."""
    if config.devices is not None or config.stages is not None:
        return config.devices, None
    present = min(CPU_DEVICES, len(jax.devices())) // config.tp
    per_device = _stages_per_device(config.schedule)
    fit = max(1, (config.layers + 1) // per_device)
    if present <= fit:
        return None, None
    runs = f"runs {per_device} stages per device" if per_device > 1 else "runs one stage each"
    return fit, (
        f"devices: {fit} of the {present} present, since {config.schedule} {runs} and "
        f"{config.layers} layers make {config.layers + 1} chain units (the blocks, then the "
        "head); set --devices or --layers to choose otherwise"
    )


def _pp_mesh(num_devices: int | None, tp: int = 1) -> jax.sharding.Mesh:
    """Returns the demo's mesh: ``pp`` of ``num_devices`` (default: every device present, at
    most 8, over ``tp``), times a ``tp`` axis of ``tp`` devices when ``tp > 1``."""
    available = jax.devices()
    count = num_devices if num_devices is not None else min(CPU_DEVICES, len(available)) // tp
    if count < 1 or count * tp > len(available):
        raise PipelineError(
            f"devices={count} x tp={tp} but only {len(available)} {available[0].platform} "
            f"devices are present; ask for at most {len(available)} in all (on CPU, run the "
            "demo in a fresh process so that it can create the host devices it needs)"
        )
    if tp == 1:
        shape, names = (count,), ("pp",)
    else:
        shape, names = (count, tp), ("pp", "tp")
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=auto, devices=available[: count * tp])


def _gpt_config(config: DemoConfig, vocab_size: int, num_stages: int):
    from models import gpt

    cfg = gpt.GPTConfig(
        vocab_size=vocab_size,
        seq_len=config.seq_len,
        d_model=config.width,
        num_heads=config.heads,
        num_layers=config.layers,
        data_seed=config.seed,
    )
    units = config.layers + 1
    if num_stages > units:
        if config.stages is not None:
            fewer = f"--stages {units} or fewer"
        else:  # the stages follow the devices
            per_device = _stages_per_device(config.schedule)
            fewer = f"--devices {units // per_device} or fewer"
            if per_device > 1:
                fewer += f" ({config.schedule} runs {per_device} stages per device)"
        raise PipelineError(
            f"{config.layers} layers make {units} chain units (the blocks, then the head), too "
            f"few for {num_stages} stages; use --layers {num_stages - 1} or more, or {fewer}"
        )
    cuts = gpt.balanced_boundaries(cfg, num_stages)
    return dataclasses.replace(cfg, stage_boundaries=cuts)


def rescale_init(params: Any, num_layers: int) -> Any:
    """Returns the GPT ``params`` with embeddings x ``EMBEDDING_INIT_SCALE`` and the residual
    projections (``attn_proj``, ``mlp_proj`` kernels) / sqrt(2 * num_layers), as in GPT-2.

    With ``models.gpt``'s 0.02 embeddings and tied head, an 8-block model sits on the unigram
    plateau (loss about 2.95 on this corpus) for over a hundred steps; this start leaves it
    after a few, so a one-minute demo shows learning.
    """

    def rescale(path: tuple, leaf: jax.Array) -> jax.Array:
        names = {getattr(key, "key", None) for key in path}
        if names & {"attn_proj", "mlp_proj"} and "kernel" in names:
            return leaf / math.sqrt(2 * num_layers)
        if names & {"embedding", "position"}:
            return leaf * EMBEDDING_INIT_SCALE
        return leaf

    return jax.tree_util.tree_map_with_path(rescale, params)


def _max_abs(x: Any) -> float:
    return float(np.max(np.abs(np.asarray(x)))) if np.size(x) else 0.0


def compare_first_step(
    loss: float, grads: Any, reference_loss: float, reference_grads: Any
) -> FirstStepCheck:
    """Returns the first-step comparison of pipelined (loss, grads) with the reference."""
    abs_diff = 0.0
    rel_diff = 0.0
    worst = ""
    passed = abs(loss - reference_loss) <= LOSS_RTOL * abs(reference_loss)
    paths = jax.tree_util.tree_flatten_with_path(reference_grads)[0]
    for (path, ref), got in zip(paths, jax.tree.leaves(grads), strict=True):
        diff = _max_abs(np.asarray(got) - np.asarray(ref))
        scale = _max_abs(ref)
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        passed = passed and diff <= GRAD_ATOL + GRAD_RTOL * scale
        if rel >= rel_diff:
            rel_diff, worst = rel, jax.tree_util.keystr(path)
        abs_diff = max(abs_diff, diff)
    return FirstStepCheck(
        loss=loss,
        reference_loss=reference_loss,
        loss_rel_diff=abs(loss - reference_loss) / abs(reference_loss),
        grad_max_abs_diff=abs_diff,
        grad_max_rel_diff=rel_diff,
        worst_leaf=worst,
        passed=passed,
    )


def compare_held_out(before: float, after: float, reference: float) -> HeldOutCheck:
    """Returns the held-out check: ``after`` (``pipe.value`` on the trained params) against
    ``reference`` (``loss_fn`` unpipelined on them) within ``LOSS_RTOL``."""
    rel = abs(after - reference) / abs(reference)
    return HeldOutCheck(before, after, reference, rel, rel <= LOSS_RTOL)


def compare_final(
    losses: Sequence[float],
    final_params: Any,
    reference_losses: Sequence[float],
    reference_params: Any,
    initial_params: Any,
) -> FinalCheck:
    """Returns the last-step comparison of a pipelined run with its unpipelined reference:
    the last loss (computed before the last update) and the params after it, the latter
    judged against the largest change training made to a parameter."""

    def largest(one: Any, other: Any) -> float:
        leaves = zip(jax.tree.leaves(one), jax.tree.leaves(other), strict=True)
        return max(
            _max_abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)) for a, b in leaves
        )

    param_diff = largest(final_params, reference_params)
    change = largest(reference_params, initial_params)
    rel = abs(losses[-1] - reference_losses[-1]) / abs(reference_losses[-1])
    return FinalCheck(
        loss=losses[-1],
        reference_loss=reference_losses[-1],
        loss_rel_diff=rel,
        param_max_abs_diff=param_diff,
        reference_losses=tuple(reference_losses),
        passed=rel <= FINAL_RTOL and param_diff <= FINAL_PARAM_RTOL * change,
        reference_param_change=change,
    )


def matrices(params: Any) -> Any:
    """Returns the weight-decay mask: True for the leaves of two or more dimensions (weight
    matrices, embeddings), False for LayerNorm scales and biases."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _adamw_step(optimizer: optax.GradientTransformation, out_shardings: Any = None):
    """Returns jitted ``(grads, state, params) -> (params, state)`` of one optimizer step;
    ``out_shardings``, when given, is (params shardings, state shardings)."""
    import optax

    def apply(grads, state, params):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(apply, out_shardings=out_shardings)


def _staged_shardings(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Returns for each leaf of staged params or optimizer state its placement on the mesh:
    ``[num_devices, L]`` rows split over ``pp`` (and their blocks over ``tp``), everything
    else (step counts) replicated."""
    tp = "tp" if "tp" in mesh.axis_names else None
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("pp", tp))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: rows if np.ndim(x) == 2 else replicated, tree)


def _reference_run(
    loss_fn: Callable[..., Any],
    params: Any,
    batches: Callable[[int], dict[str, np.ndarray]],
    num_steps: int,
    optimizer: optax.GradientTransformation,
) -> tuple[list[float], Any, tuple[float, Any]]:
    """Returns (losses, final params, (first loss, first grads)) of unpipelined training."""
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    apply = _adamw_step(optimizer)
    state = optimizer.init(params)
    losses = []
    first = None
    for step in range(num_steps):
        loss, grads = value_and_grad(params, batches(step))
        if first is None:
            first = (float(loss), jax.tree.map(np.asarray, grads))
        losses.append(float(loss))
        params, state = apply(grads, state, params)
    assert first is not None
    return losses, params, first


def run_demo(
    config: DemoConfig,
    on_report: Callable[[str], None] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
) -> DemoResult:
    """Returns the ``DemoResult`` of training the GPT pipelined as ``config`` says.

    ``on_report`` receives the pipeline report (stages, params per stage, schedule grid,
    per-device memory) once the step is compiled; ``on_step`` receives every finished step.
    The steps run the executable of ``pipe.lower(staged, batch, buffers=buffers).compile()``,
    which is ``pipe.value_and_grad(..., buffers=)`` compiled ahead of time.
    """
    import optax

    from models import gpt

    started = time.perf_counter()
    _check_config(config)
    _make_dirs(config)
    request_cpu_devices(config.devices and config.devices * config.tp)
    devices, chosen = _default_devices(config)
    mesh = _pp_mesh(devices, config.tp)
    num_devices = int(mesh.shape["pp"])
    num_stages, placement = _stages_and_placement(config, num_devices)

    tokenizer = CharTokenizer()
    corpus = tokenizer.encode(synthetic_text(config.corpus_chars, seed=config.seed))
    cfg = _gpt_config(config, tokenizer.vocab_size, num_stages)

    def batches(step: int) -> dict[str, np.ndarray]:
        return batch_at(corpus, step, config.batch_size, config.seq_len, seed=config.seed)

    # Text the training never sees: the same grammar, drawn from another seed.
    held_out_corpus = tokenizer.encode(
        synthetic_text(max(config.corpus_chars // 8, 4 * config.seq_len), seed=config.seed + 1)
    )
    held_out_batch = batch_at(
        held_out_corpus, 0, config.batch_size, config.seq_len, seed=config.seed + 1
    )

    notes: list[str] = [chosen] if chosen is not None else []
    loss_fn = gpt.make_loss_fn(cfg)
    params = rescale_init(gpt.init_params(jax.random.key(config.seed), cfg), cfg.num_layers)
    pipe = make_pipeline(
        loss_fn,
        mesh=mesh,
        axis_name="pp",
        schedule=config.schedule,
        num_microbatches=config.microbatches,
        num_stages=num_stages,
        placement=placement,
        param_specs=(
            gpt.tensor_parallel_specs(params, "tp", config.tp, cfg.num_heads)
            if config.tp > 1
            else None
        ),
    )
    # The user-layout optimizer (the reference run's); the pipelined steps run it per leaf.
    optimizer = optax.adamw(config.lr, weight_decay=config.weight_decay, mask=matrices)
    phases: list[tuple[str, float]] = [("setup", time.perf_counter() - started)]
    tick = time.perf_counter()
    pipe.lower(params, batches(0))  # builds the stage programs, so that params can be staged
    staged = pipe.stage(params)
    phases.append(("trace, partition, split, lower", time.perf_counter() - tick))
    # The schedule that runs, simulated with the costs the report uses.
    costs = program_costs(pipe.programs)
    simulated = schedules.simulate(pipe.schedule, costs)
    tick = time.perf_counter()
    # Compiled ahead of time, so that the first step's time is a step's, not the compiler's;
    # the report reads its memory from this compile instead of compiling one of its own.
    # The step runs in arenas kept from step to step (donated to it), not in new ones.
    buffers = pipe.init_buffers(staged, batches(0))
    step_fn = pipe.lower(staged, batches(0), buffers=buffers).compile()
    phases.append(("compile", time.perf_counter() - tick))
    if on_report is not None:
        tick = time.perf_counter()
        on_report((f"{chosen}\n" if chosen else "") + pipe.report(step_fn))
        phases.append(("report", time.perf_counter() - tick))
    # Every step's inputs carry the same shardings, so the update compiles once, not twice.
    staged_optimizer = pipe.per_leaf(optimizer)
    state = staged_optimizer.init(staged)
    shardings = (_staged_shardings(staged, mesh), _staged_shardings(state, mesh))
    staged, state = jax.device_put((staged, state), shardings)
    apply = _adamw_step(staged_optimizer, out_shardings=shardings)

    tick = time.perf_counter()
    held_out_before = float(pipe.value(staged, held_out_batch))  # the forwards alone
    evaluating = time.perf_counter() - tick

    tokens_per_step = config.batch_size * config.seq_len
    # Profile two steps after the first, whose time is mostly compilation.
    profile_start = min(1, config.steps - 1)
    profile_last = min(profile_start + 1, config.steps - 1)
    losses: list[float] = []
    seconds: list[float] = []
    first_grads = None
    for step in range(config.steps):
        batch = batches(step)
        profiling = config.profile_dir is not None and profile_start <= step <= profile_last
        if profiling and step == profile_start:
            jax.profiler.start_trace(config.profile_dir)
        tick = time.perf_counter()
        annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
        with annotation if profiling else nullcontext():
            # = pipe.value_and_grad(staged, batch, buffers=buffers)
            loss, grads, buffers = step_fn(staged, batch, None, buffers)
            staged, state = apply(grads, state, staged)
            loss = float(loss)
            jax.block_until_ready(staged)
        elapsed = time.perf_counter() - tick
        if profiling and step == profile_last:
            jax.profiler.stop_trace()
        if step == 0:
            first_grads = jax.tree.map(np.asarray, pipe.unstage(grads))
        losses.append(loss)
        seconds.append(elapsed)
        if on_step is not None:
            on_step(
                StepInfo(
                    step=step,
                    num_steps=config.steps,
                    loss=loss,
                    seconds=elapsed,
                    tokens_per_second=tokens_per_step / elapsed,
                    bubble_rate=simulated.bubble_rate,
                )
            )

    phases.append(("steps", sum(seconds)))
    tick = time.perf_counter()
    held_out = compare_held_out(
        held_out_before,
        float(pipe.value(staged, held_out_batch)),
        float(jax.jit(loss_fn)(pipe.unstage(staged), held_out_batch)),
    )
    phases.append(("held-out evaluation", evaluating + time.perf_counter() - tick))
    # The trace shows microseconds: it gets the cost estimates scaled so that the simulated
    # step lasts as long as the measured one (a median after the first, which compiles).
    step_time = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    files = _write_schedule_files(
        pipe.schedule, costs, config.out_dir, notes, step_time, simulated.makespan
    )
    if config.profile_dir is not None:
        files += (str(config.profile_dir),)
    traced = None
    if config.profile_dir is not None:
        # The steps after the first, which compiled nothing, and not traced.
        untraced = [t for i, t in enumerate(seconds) if i > profile_last]
        try:
            traced = action_times(
                config.profile_dir,
                step_fn.as_text(),
                profile_last - profile_start + 1,
                pipe.schedule,
                statistics.median(untraced) if untraced else None,
                statistics.median(seconds[profile_start : profile_last + 1]),
            )
        except PipelineError as err:  # a backend whose trace names no HLO ops: say so
            notes.append(f"no time per action from the trace: {err}")
    tick = time.perf_counter()
    reference_losses, reference_final, (ref_loss, ref_grads) = _reference_run(
        loss_fn, params, batches, config.steps if config.check_final else 1, optimizer
    )
    phases.append(("unpipelined reference run", time.perf_counter() - tick))
    first_step = compare_first_step(losses[0], first_grads, ref_loss, ref_grads)
    final = None
    if config.check_final:
        final = compare_final(
            losses, pipe.unstage(staged), reference_losses, reference_final, params
        )
    return DemoResult(
        config=config,
        num_devices=num_devices,
        num_stages=num_stages,
        num_params=sum(int(np.size(x)) for x in jax.tree.leaves(params)),
        losses=tuple(losses),
        step_seconds=tuple(seconds),
        tokens_per_step=tokens_per_step,
        bubble_rate=simulated.bubble_rate,
        first_step=first_step,
        final=final,
        files=files,
        notes=tuple(notes),
        phase_seconds=tuple(phases),
        wall_seconds=time.perf_counter() - started,
        action_times=traced,
        held_out=held_out,
    )


def _write_schedule_files(
    schedule: schedules.Schedule,
    costs: schedules.Costs,
    out_dir: str | None,
    notes: list[str],
    step_seconds: float,
    makespan: float,
) -> tuple[str, ...]:
    """Returns the paths written: the schedule's Perfetto trace and (with matplotlib) Gantt PNG.

    The costs are FLOP-and-byte estimates (1e6 to 1e9 units an action), so the trace, whose
    times Perfetto reads as microseconds, gets them scaled to make the simulated ``makespan``
    last ``step_seconds``; the Gantt chart keeps cost units and says so on its axis.
    """
    if out_dir is None:
        return ()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    unit_us = step_seconds * 1e6 / makespan
    trace = schedules.write_trace(schedule, out / "schedule_trace.json", costs, unit_us)
    written = [str(trace)]
    notes.append(
        f"{trace}: the simulated schedule, its cost estimates scaled so that the step lasts "
        f"the median measured step ({step_seconds * 1e3:.1f} ms)"
    )
    try:
        schedules.gantt(
            schedule, costs, path=out / "schedule.png", title=f"{schedule.name} (simulated)"
        )
        written.append(str(out / "schedule.png"))
    except ImportError as err:  # matplotlib is an optional extra
        notes.append(f"no Gantt chart: {err}")
    return tuple(written)


class Progress:
    """Prints training progress: a refreshing bar on a terminal, plain lines in a log."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, width: int = 24):
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width

    def line(self, info: StepInfo) -> str:
        """Returns the text for one step: counter, bar (on a terminal), loss, speed, bubble."""
        count = f"step {info.step + 1:>{len(str(info.num_steps))}}/{info.num_steps}"
        text = (
            f"loss {info.loss:.4f} | {info.seconds * 1e3:6.0f} ms "
            f"{info.tokens_per_second:>8,.0f} tok/s | simulated bubble {info.bubble_rate:.1%}"
        )
        if not self.tty:
            return f"{count} | {text}"
        done = round(self.width * (info.step + 1) / info.num_steps)
        bar = "#" * done + "." * (self.width - done)
        return f"{count} [{bar}] {text}"

    def __call__(self, info: StepInfo) -> None:
        last = info.step + 1 == info.num_steps
        if self.tty:
            end = "\n" if last else ""
            self.stream.write("\r" + self.line(info) + end)
            self.stream.flush()
            return
        every = max(1, info.num_steps // 50)
        if info.step % every == 0 or last:
            print(self.line(info), file=self.stream, flush=True)


def summary(result: DemoResult) -> str:
    """Returns the closing text: loss curve, speed, checks with PASS/FAIL, files written."""
    losses = result.losses
    timed = result.step_seconds[1:]
    if timed:
        mean_step = sum(timed) / len(timed)
        trend = "decreased" if result.loss_decreased else "did NOT decrease"
        speed = f"{mean_step * 1e3:.1f} ms/step after the first"
    else:  # one step: no trend, and its time includes compiling the step
        mean_step = result.step_seconds[0]
        trend = "one step: no trend"
        speed = f"{mean_step * 1e3:.1f} ms for the one step, compilation included"
    lines = [
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps ({trend}); "
        f"{speed} ({result.tokens_per_step / mean_step:,.0f} tokens/s); wall "
        f"{result.wall_seconds:.1f} s",
        _curve(losses),
        f"simulated bubble {result.bubble_rate:.1%}: the schedule that ran, simulated with the "
        "stage programs' own cost estimates (as in the report above)",
        "time: " + ", ".join(f"{name} {sec:.1f} s" for name, sec in result.phase_seconds),
    ]
    first = result.first_step
    lines.append(
        f"first step vs jax.value_and_grad (unpipelined): loss {first.loss:.6f} vs "
        f"{first.reference_loss:.6f} (rel diff {first.loss_rel_diff:.1e}); grads max abs diff "
        f"{first.grad_max_abs_diff:.1e}, max rel diff {first.grad_max_rel_diff:.1e} "
        f"(worst leaf {first.worst_leaf}) ... {'PASS' if first.passed else 'FAIL'}"
    )
    if result.final is not None:
        final = result.final
        lines.append(
            f"final loss vs unpipelined adamw run of the same {len(losses)} steps: "
            f"{final.loss:.6f} vs {final.reference_loss:.6f} (rel diff "
            f"{final.loss_rel_diff:.1e}, tolerance {FINAL_RTOL:g}); params after the last "
            f"update: max abs diff {final.param_max_abs_diff:.1e}, "
            f"{final.param_max_abs_diff / max(final.reference_param_change, 1e-30):.1%} of the "
            f"largest change training made ({final.reference_param_change:.1e}; tolerance "
            f"{FINAL_PARAM_RTOL:.0%}) ... {'PASS' if final.passed else 'FAIL'}"
        )
    if result.held_out is not None:
        held = result.held_out
        lines.append(
            f"held-out loss (pipe.value, the forwards alone): {held.before:.4f} before "
            f"training, {held.after:.4f} after; loss_fn unpipelined on the trained params "
            f"{held.reference:.6f} (rel diff {held.rel_diff:.1e}) ... "
            f"{'PASS' if held.passed else 'FAIL'}"
        )
    if result.action_times is not None:
        lines += [
            f"time per action in the {result.action_times.steps} profiled steps (summed from "
            "the trace's ops by the action's named scope; exchanges include waiting for the "
            "other devices; step: the median wall time of the steps after the profiled ones, "
            "traced step: of the profiled ones):",
            result.action_times.table(),
        ]
    lines += [f"wrote {path}" for path in result.files]
    lines += list(result.notes)
    return "\n".join(lines)


def _curve(losses: Sequence[float], points: int = 10) -> str:
    """Returns up to ``points`` (step, loss) pairs spread over the run, as one line."""
    n = len(losses)
    count = min(points, n)
    picks = sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})
    return "loss curve: " + ", ".join(f"{i + 1}:{losses[i]:.3f}" for i in picks)
