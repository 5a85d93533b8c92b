"""Time per action of the compiled step, read from a ``jax.profiler`` trace.

The lowering runs every action inside a ``jax.named_scope`` named by its kind and stage
(``"F s1"``, ``"B s1"``, ``"W s0"``, ``"BW s0"``), and XLA keeps the scope in the metadata
(``op_name``) of every HLO instruction the action compiles to. A ``jax.profiler`` trace records
one event per executed instruction (on XLA:CPU, per thunk, with its ``hlo_op``, ``hlo_module``
and ``device_ordinal``; on GPUs, per kernel on a stream line of its device). Adding the events'
intervals up by the scope of their instruction (overlaps split, not counted twice) gives each
action's time on each device in the real step, next to the time the step spends in its
exchanges (collectives) and between actions (the tick loop: slot bookkeeping, branch
selection).

Events of control-flow instructions (``while``, ``conditional``, ``call``) span the events of
the instructions they run, so they are not counted. On GPUs, XLA may run several instructions
as one command buffer (a CUDA graph), whose kernels carry the command buffer's name; such time
is attributed to the command buffer's own scope, usually none (``XLA_FLAGS=
--xla_gpu_enable_command_buffer=`` turns command buffers off for a finer profile).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zbjax.errors import PipelineError
from zbjax.schedules.ir import Costs, Schedule


def make_output_dir(name: str, path: str) -> None:
    """Makes the directory ``path`` (and its parents) for output files or a ``jax.profiler``
    trace, or raises PipelineError naming ``name``: the profiler itself fails only when it
    stops, after the traced steps ran, and then stays running."""
    if not str(path):
        raise PipelineError(
            f"{name}='' is not a directory name; give a directory to write into (it is made if "
            "missing), e.g. '.' for this one"
        )
    if Path(path).exists() and not Path(path).is_dir():
        raise PipelineError(
            f"{name}={str(path)!r} is a file, not a directory; give a directory to write into "
            "(it is made if missing)"
        )
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PipelineError(
            f"{name}={str(path)!r} cannot be made a directory ({err.strerror or err}); give a "
            "directory to write into"
        ) from None


#: An action's named scope as a component of an instruction's ``op_name`` path.
ACTION_SCOPE = re.compile(r"(?:^|/)((?:F|B|W|BW) s\d+)(?=/|$)")
#: The bucket of instructions outside any action that move data between devices.
EXCHANGES = "exchanges"
#: The bucket of every other instruction outside the actions (the tick loop's own work).
BETWEEN = "between actions"
#: Opcodes whose events contain the events of the instructions they run.
CONTROL_OPCODES = frozenset({"while", "conditional", "call"})
_COLLECTIVE = re.compile(
    r"^(collective-permute|all-reduce|all-gather|reduce-scatter|all-to-all|send|recv)"
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULE = re.compile(r"^HloModule ([\w.\-]+)", re.M)
_DEVICE_PROCESS = re.compile(r"/device:\w+:(\d+)")


@dataclass(frozen=True)
class HloOps:
    """Where the instructions of one compiled module belong.

    ``scope[name]`` is the action scope (``"F s1"``) of instruction ``name``, or ``EXCHANGES``
    or ``BETWEEN``; ``control`` holds the control-flow instructions, whose events are not
    counted."""

    module: str
    scope: Mapping[str, str]
    control: frozenset[str]


def _opcode(rest: str) -> str:
    """Returns the opcode of an instruction from the text after its ``=`` (shape, opcode,
    operands...); a tuple shape is skipped by its parentheses."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    return rest.strip().split("(", 1)[0]


def hlo_ops(hlo_text: str) -> HloOps:
    """Returns where each instruction of the compiled module ``hlo_text`` (``Compiled.as_text()``)
    belongs, from its opcode and its ``op_name`` metadata."""
    module = _MODULE.search(hlo_text)
    if module is None:
        raise PipelineError(
            "the text is not a compiled HLO module (no 'HloModule' line); pass "
            "compiled.as_text() of the step that was traced"
        )
    scope: dict[str, str] = {}
    control: set[str] = set()
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, rest = m.groups()
        opcode = _opcode(rest)
        if opcode in CONTROL_OPCODES:
            control.add(name)
        op_name = _OP_NAME.search(rest)
        scopes = ACTION_SCOPE.findall(op_name.group(1)) if op_name else []
        if scopes:
            scope[name] = scopes[-1]
        elif _COLLECTIVE.match(opcode):
            scope[name] = EXCHANGES
        else:
            scope[name] = BETWEEN
    return HloOps(module.group(1), scope, frozenset(control))


_CALLS = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_PAIR = re.compile(r"\{(\d+),(\d+)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_FIELD = re.compile(r"(\w+)=(\d+)")
_PACKAGE = str(Path(__file__).resolve().parent) + "/"


@dataclass(frozen=True)
class Permute:
    """A collective-permute of a compiled module: its ``op_name`` metadata (the JAX name stack
    and primitive it came from) and its (source, target) partition pairs."""

    op_name: str
    pairs: tuple[tuple[int, int], ...]
    #: Where the user's code made it ("model.py:17 in mlp"), when the module records it.
    source: str = ""


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Returns each computation's instruction lines by name: a computation starts at an
    unindented line ending in ``{`` (``%name (params) -> shape {`` or ``ENTRY ...``) and ends at
    a line ``}``."""
    comps: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            words = line.split()
            name = words[1] if words[0] == "ENTRY" else words[0]
            body = comps.setdefault(name.lstrip("%"), [])
        elif line.strip() == "}":
            body = None
        elif body is not None:
            body.append(line)
    return comps


def branch_permutes(hlo_text: str) -> list[Permute]:
    """Returns the collective-permutes of the compiled module ``hlo_text``
    (``Compiled.as_text()``) that run inside a branch of a conditional: in a branch
    computation or one it calls (a loop, a fusion, a nested conditional)."""
    comps = _computations(hlo_text)
    frames = _stack_frames(hlo_text)
    calls: dict[str, set[str]] = {name: set() for name in comps}
    roots: set[str] = set()
    for name, lines in comps.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m is None:
                continue
            called = {
                c.strip().lstrip("%")
                for group in _CALLS.findall(m.group(2))
                for c in group.strip("{}").split(",")
                if c.strip()
            }
            calls[name] |= called
            if _opcode(m.group(2)) == "conditional":
                roots |= called
    inside: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo.extend(calls.get(name, ()))
    found = []
    for name in sorted(inside):
        for line in comps.get(name, ()):
            m = _INSTRUCTION.match(line)
            if m is None or not _opcode(m.group(2)).startswith("collective-permute"):
                continue
            pairs = _PAIRS.search(m.group(2))
            op_name = _OP_NAME.search(m.group(2))
            found.append(
                Permute(
                    op_name.group(1) if op_name else "",
                    tuple(
                        (int(a), int(b)) for a, b in _PAIR.findall(pairs.group(1) if pairs else "")
                    ),
                    _source(m.group(2), frames),
                )
            )
    return found


def _source(instruction: str, frames: Mapping[int, str]) -> str:
    """Returns where an instruction's metadata says the user's code that made it stands (its
    ``source_file``/``source_line``, or its ``stack_frame_id`` in the module's frame tables),
    or "" where it does not say or names zbjax's own code."""
    source = _SOURCE.search(instruction)
    if source:
        where = f"{source.group(1)}:{source.group(2)}"
    else:
        frame = _FRAME_ID.search(instruction)
        where = frames.get(int(frame.group(1)), "") if frame else ""
    # zbjax's own code (the tick loop, message packing) is no line for a user to change.
    return "" if where.startswith(_PACKAGE) else where


def _stack_frames(hlo_text: str) -> dict[int, str]:
    """Returns "file:line in function" per stack frame id of a module's text, read from the
    tables it prints before its computations (FileNames, FunctionNames, FileLocations,
    StackFrames: a frame names a location, a location a file, function and line)."""
    tables: dict[str, dict[int, str]] = {}
    rows: dict[int, str] | None = None
    for line in hlo_text.splitlines():
        if line in _TABLES:
            rows = tables.setdefault(line, {})
        elif rows is not None and line[:1].isdigit() and " " in line:
            number, rest = line.split(" ", 1)
            rows[int(number)] = rest.strip()
        else:
            rows = None
    names = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    places = {}
    for number, row in tables.get("FileLocations", {}).items():
        fields = {k: int(v) for k, v in _FIELD.findall(row)}
        place = f"{names.get(fields.get('file_name_id'), '?')}:{fields.get('line', '?')}"
        function = functions.get(fields.get("function_name_id"))
        places[number] = f"{place} in {function}" if function else place
    frames = {}
    for number, row in tables.get("StackFrames", {}).items():
        fields = {k: int(v) for k, v in _FIELD.findall(row)}
        if fields.get("file_location_id") in places:
            frames[number] = places[fields["file_location_id"]]
    return frames


def trace_events(trace_dir: str | Path) -> list[dict[str, Any]]:
    """Returns the events of the newest ``*.trace.json.gz`` that ``jax.profiler`` wrote under
    ``trace_dir``."""
    paths = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not paths:
        raise PipelineError(
            f"no *.trace.json.gz under {str(trace_dir)!r}; pass the directory given to "
            "jax.profiler.trace (or start_trace) after the trace stopped"
        )
    with gzip.open(paths[-1]) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def op_seconds(events: Iterable[Mapping[str, Any]], ops: HloOps) -> dict[int, dict[str, float]]:
    """Returns the seconds the traced events of ``ops``' module spent per device and scope
    (action scope, ``EXCHANGES`` or ``BETWEEN``), control-flow events left out.

    A scope's time on a device is its share of the time the device's events cover: XLA:CPU
    runs independent ops at the same time on its threads (the dots of one W; ops of two
    actions or of an action and the tick loop), and a GPU may run kernels on several streams,
    so summing the events' durations would count the overlap twice (on one core, more than the
    step's wall time). A scope's own overlapping events count once; time in which events of
    several scopes overlap is split evenly among them."""
    events = list(events)
    devices = {
        e["pid"]: int(m.group(1))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
        for m in [_DEVICE_PROCESS.search(str((e.get("args") or {}).get("name", "")))]
        if m is not None
    }
    # On a device's own lines, kernels sit on its streams' lines; the other lines ("XLA Ops",
    # "XLA Modules") summarise the same time again.
    streams = {
        (e["pid"], e.get("tid"))
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and e.get("pid") in devices
        and "Stream" in str((e.get("args") or {}).get("name", ""))
    }
    spans: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        op = args.get("hlo_op")
        if e.get("ph") != "X" or op is None or op in ops.control:
            continue
        if args.get("hlo_module", ops.module) != ops.module or op not in ops.scope:
            continue
        if e.get("pid") in devices and (e["pid"], e.get("tid")) not in streams:
            continue
        ordinal = args.get("device_ordinal")
        device = devices.get(e.get("pid"), 0) if ordinal is None else int(ordinal)
        start = float(e.get("ts", 0.0))
        spans[device].append((start, start + float(e.get("dur", 0.0)), ops.scope[op]))
    return {d: {k: v * 1e-6 for k, v in _shares(spans[d]).items()} for d in sorted(spans)}


def _shares(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Returns each scope's share of the time the ``(start, end, scope)`` spans cover: where
    spans of several scopes overlap, the time is split evenly among those scopes; a scope's
    own overlapping spans count once."""
    edges = sorted({t for lo, hi, _ in spans for t in (lo, hi)})
    starts = collections.defaultdict(list)
    for lo, hi, scope in spans:
        starts[lo].append((hi, scope))
    share: dict[str, float] = collections.defaultdict(float)
    active: list[tuple[float, str]] = []
    for left, right in zip(edges, edges[1:], strict=False):
        active = [(hi, scope) for hi, scope in active + starts.get(left, []) if hi > left]
        scopes = {scope for _, scope in active}
        for scope in scopes:
            share[scope] += (right - left) / len(scopes)
    return dict(share)


@dataclass(frozen=True)
class ActionTimes:
    """Each action's time in the real step, per device, from a ``jax.profiler`` trace.

    ``seconds[device][scope]``: seconds per step on that device (XLA's device ordinal) in the
    action scope (``"F s1"``), in ``EXCHANGES`` or ``BETWEEN``; ``runs[scope]``: how often
    the schedule runs that action per step on its device (m for most); ``step_seconds``: the
    step's wall time untraced, ``traced_step_seconds`` traced (tracing slows a step; the mean
    over the traced steps, as ``seconds`` is), when known. The ops' events do not cover the
    whole step: the executor's own time between ops and the step's launch are in no event."""

    steps: int
    seconds: Mapping[int, Mapping[str, float]]
    runs: Mapping[str, int]
    step_seconds: float | None = None
    traced_step_seconds: float | None = None
    empty: frozenset[str] = frozenset()  # actions with no op in the compiled step

    def per_run(self, scope: str, device: int | None = None) -> float:
        """Returns the seconds one run of action ``scope`` took, averaged over its runs (on
        ``device``, else on the first device that ran it); 0.0 for an action whose program
        compiled to no op (a first stage's B, with no input gradient to compute), whatever
        ``device``: the trace does not say where such an action ran."""
        if scope not in self.runs:
            raise PipelineError(f"no action {scope!r}; the schedule runs {sorted(self.runs)}")
        if scope in self.empty:
            return 0.0
        ran = [d for d, s in self.seconds.items() if scope in s]
        if not ran:
            raise PipelineError(f"the trace holds no event of action {scope!r}")
        if device is not None and device not in ran:
            raise PipelineError(f"device {device} ran no {scope!r}; devices {ran} did")
        return self.seconds[ran[0] if device is None else device][scope] / self.runs[scope]

    def costs(self, base: Costs) -> Costs:
        """Returns ``base`` (seconds, as ``Pipeline.measure_costs`` gives them) with the time
        of every action this profile ran replaced by its time per run in the step, on the
        device that ran it, the others (and ``comm``) kept: costs to plan a pipeline by what
        its actions cost inside the step rather than alone (``pipeline(costs=...)``). A
        profile of a schedule that runs a stage's backward fused gives its BW, one that
        splits it its B and W: chain two profiles' ``costs`` for all three."""
        if not isinstance(base, Costs):
            raise PipelineError(
                f"ActionTimes.costs takes the base Costs (pipe.measure_costs(params, batch)), "
                f"not {type(base).__name__}"
            )
        ran = {  # actions with no op in the step ran too, in no time
            scope_kind_stage(scope): self.per_run(scope)
            for scope in self.runs
            if scope in self.empty or any(scope in s for s in self.seconds.values())
        }
        n = 1 + max(scope_kind_stage(scope)[1] for scope in self.runs)
        f, b, w = (list(t) for t in base.per_stage(n))
        for (kind, stage), seconds in ran.items():
            if kind != "BW":
                {"F": f, "B": b, "W": w}[kind][stage] = seconds
        fused = {stage: seconds for (kind, stage), seconds in ran.items() if kind == "BW"}
        bw = None
        if base.bw is not None or fused:
            # A stage whose BW neither ran nor was given costs its B + W, as Costs has it.
            given = base.fused_per_stage(n) if base.bw is not None else None
            bw = tuple(
                fused.get(s, given[s] if given is not None else b[s] + w[s]) for s in range(n)
            )
        return dataclasses.replace(base, f=tuple(f), b=tuple(b), w=tuple(w), bw=bw)

    def action_seconds(self, device: int) -> float:
        """Returns the seconds per step ``device`` spent in actions (exchanges and the tick
        loop's own work left out)."""
        if device not in self.seconds:
            raise PipelineError(f"no device {device!r} in the trace; it holds {list(self.seconds)}")
        return sum(v for s, v in self.seconds[device].items() if s in self.runs)

    def table(self) -> str:
        """Returns a text table: per action and device, runs per step and milliseconds per run
        and per step; then per device, the step's time in actions, exchanges and between
        actions."""
        lines = ["action  device  runs/step    ms/run   ms/step"]
        for device, scopes in self.seconds.items():
            for scope in sorted((s for s in scopes if s in self.runs), key=scope_order):
                runs = self.runs[scope]
                lines.append(
                    f"{scope:<7} {device:>6} {runs:>10} {scopes[scope] / runs * 1e3:>9.3f} "
                    f"{scopes[scope] * 1e3:>9.3f}"
                )
        for device, scopes in self.seconds.items():
            actions = self.action_seconds(device)
            step = "".join(
                f"; {what} {value * 1e3:.3f}"
                for what, value in (
                    ("step", self.step_seconds),
                    ("traced step", self.traced_step_seconds),
                )
                if value is not None
            )
            lines.append(
                f"device {device}: actions {actions * 1e3:.3f}, {EXCHANGES} "
                f"{scopes.get(EXCHANGES, 0.0) * 1e3:.3f}, {BETWEEN} "
                f"{scopes.get(BETWEEN, 0.0) * 1e3:.3f} ms per step{step}"
            )
        return "\n".join(lines)


def scope_kind_stage(scope: str) -> tuple[str, int]:
    """Returns the kind and stage of an action scope: ``"W s1"`` -> ``("W", 1)``."""
    kind, stage = scope.split(" s")
    return kind, int(stage)


def scope_order(scope: str) -> tuple[int, int]:
    """Returns the sort key of an action scope (``"W s1"``): by stage, then F, B, W, BW."""
    kind, stage = scope_kind_stage(scope)
    return stage, ("F", "B", "W", "BW").index(kind)


def scope_cost(costs: Costs, scope: str) -> float:
    """Returns the time ``costs`` gives the action ``scope`` (``"W s1"``): what
    ``Pipeline.measure_costs`` measured for it alone, to set beside ``ActionTimes.per_run``."""
    kind, stage = scope_kind_stage(scope)
    times = {"F": costs.f, "B": costs.b, "W": costs.w, "BW": costs.bw}[kind]
    if times is None:
        raise PipelineError(f"the costs hold no fused backward time for {scope!r}")
    return times[stage]


def action_runs(schedule: Schedule) -> dict[str, int]:
    """Returns how often each action scope runs per step on its device under ``schedule``."""
    return dict(
        collections.Counter(f"{a.kind} s{a.stage}" for acts in schedule.actions for a in acts)
    )


def action_times(
    trace_dir: str | Path,
    hlo_text: str,
    steps: int,
    schedule: Schedule,
    step_seconds: float | None = None,
    traced_step_seconds: float | None = None,
) -> ActionTimes:
    """Returns the ``ActionTimes`` of ``steps`` steps of the compiled step ``hlo_text`` (its
    ``as_text()``) traced into ``trace_dir`` under ``schedule`` (the lowering's, as run);
    ``step_seconds`` and ``traced_step_seconds``: the step's wall times, untraced and traced,
    when known."""
    if steps < 1:
        raise PipelineError(f"steps={steps}; it must be at least 1")
    ops = hlo_ops(hlo_text)
    total = op_seconds(trace_events(trace_dir), ops)
    if not total:
        raise PipelineError(
            f"the trace under {str(trace_dir)!r} holds no event of module {ops.module!r}; "
            "trace the steps of the very executable whose text was passed"
        )
    seconds = {d: {s: v / steps for s, v in scopes.items()} for d, scopes in total.items()}
    runs = action_runs(schedule)
    empty = frozenset(runs) - frozenset(ops.scope.values())
    return ActionTimes(steps, seconds, runs, step_seconds, traced_step_seconds, empty)
