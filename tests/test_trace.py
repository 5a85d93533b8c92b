"""Per-action times of the compiled step from a jax.profiler trace (zbjax.trace)."""

import collections
import gzip
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import zbjax
from models import mlp
from zbjax import trace
from zbjax.trace import (
    BETWEEN,
    EXCHANGES,
    ActionTimes,
    action_runs,
    action_times,
    branch_permutes,
    hlo_ops,
    op_seconds,
    scope_cost,
)


def _instr(text: str, op_name: str | None = None) -> str:
    """Returns an HLO instruction line as XLA prints it, with its op_name metadata."""
    return "  " + text + (f', metadata={{op_name="{op_name}"}}' if op_name else "")


HLO = "\n".join(
    [
        "HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}",
        "",
        "%branch (p: f32[4]) -> f32[4] {",
        _instr("%p = f32[4]{0} parameter(0)"),
        _instr(
            "ROOT %fusion.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%f1",
            "jit(step)/shard_map/while/body/F s1/tanh",
        ),
        "}",
        "",
        "ENTRY %main (a: f32[4]) -> f32[4] {",
        _instr("%a = f32[4]{0} parameter(0)"),
        _instr("%dot.2 = f32[4]{0} dot(%a, %a)", "jit(step)/W s0/dot_general"),
        _instr("%cp = f32[4]{0} collective-permute(%dot.2), source_target_pairs={{0,1}}"),
        _instr(
            "%cond = (f32[4]{0}, s32[]) conditional(%i, %a, %a), "
            "branch_computations={%branch, %branch}",
            "jit(step)/F s1/cond",
        ),
        _instr("ROOT %copy.3 = f32[4]{0} copy(%cp)", "jit(step)/while/body/dynamic_slice"),
        "}",
    ]
)


def _event(op, dur, device=None, module="jit_step", pid=1, ts=0.0):
    args = {"hlo_op": op, "hlo_module": module}
    if device is not None:
        args["device_ordinal"] = str(device)
    return {"ph": "X", "pid": pid, "tid": 7, "name": op, "ts": ts, "dur": dur, "args": args}


def test_branch_permutes_lists_the_collective_permutes_inside_conditionals():
    """The permute under the cond (in its branch, inside a loop there) is listed with its
    pairs and name stack; the one on every device, outside the cond, is not."""
    mesh = jax.sharding.Mesh(jax.devices()[:8], ("x",))

    def shift(v, step):
        return jax.lax.ppermute(v, "x", [(i, (i + step) % 8) for i in range(8)])

    line = shift.__code__.co_firstlineno + 1  # the ppermute's

    def body(v, flag):
        v = shift(v, 1)
        inner = jax.named_scope("inner")(
            lambda v: jax.lax.fori_loop(0, 2, lambda i, v: shift(v, 2) * 2, v)
        )
        return jax.lax.cond(flag[0], inner, lambda v: v, v)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    hlo = step.lower(jnp.ones(8), jnp.ones(8, bool)).compile().as_text()
    found = branch_permutes(hlo)
    assert [p.pairs for p in found] == [tuple((i, (i + 2) % 8) for i in range(8))]
    assert "inner" in found[0].op_name
    # Where the user's code made it, from the module's stack frame tables.
    assert found[0].source == f"{__file__}:{line} in {shift.__qualname__}"


def test_hlo_ops_place_every_instruction_in_its_action_exchanges_or_between():
    ops = hlo_ops(HLO)
    assert ops.module == "jit_step"
    assert ops.scope["fusion.1"] == "F s1" and ops.scope["dot.2"] == "W s0"
    assert ops.scope["cp"] == EXCHANGES and ops.scope["copy.3"] == BETWEEN
    assert ops.control == {"cond"}  # a tuple-shaped conditional: its events span its branch's
    with pytest.raises(zbjax.PipelineError, match="HloModule"):
        hlo_ops("not hlo")


def test_op_seconds_share_the_time_events_cover_per_device_leaving_control_and_other_modules():
    events = [
        _event("fusion.1", 100.0, device=1, ts=0.0),
        _event("fusion.1", 50.0, device=1, ts=200.0),
        # Independent ops of one action run at once on XLA:CPU's threads: the overlap counts
        # once, so 230..250 adds nothing, 250..260 does. An op on device 0 at the same time
        # is device 0's alone. A zero-length event takes no share.
        {**_event("fusion.1", 30.0, device=1, ts=230.0), "tid": 8},
        _event("fusion.1", 30.0, device=0, ts=230.0),
        _event("cp", 0.0, device=0, ts=230.0),
        _event("cond", 1000.0, device=1),  # contains fusion.1: not counted again
        # Ops of different scopes at once on device 0: 10..15 is split between W s0 and the
        # exchange, so the scopes' times add up to the 0..20 the events cover.
        _event("dot.2", 20.0, device=0, ts=0.0),
        _event("cp", 5.0, device=0, ts=10.0),
        _event("copy.3", 2.0, device=0, ts=100.0),
        _event("dot.2", 999.0, device=0, module="jit_update"),  # another program's op
        # GPU-style events: no device_ordinal, the device read from its process's name; only
        # the kernels on a stream's line count, not the line that summarises them again.
        {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/device:GPU:3"}},
        {"ph": "M", "pid": 9, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13"}},
        {"ph": "M", "pid": 9, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        _event("dot.2", 30.0, pid=9),
        {**_event("dot.2", 30.0, pid=9), "tid": 8},
    ]
    got = op_seconds(events, hlo_ops(HLO))
    want = {
        1: {"F s1": 160e-6},
        0: {"F s1": 30e-6, "W s0": 17.5e-6, EXCHANGES: 2.5e-6, BETWEEN: 2e-6},
        3: {"W s0": 30e-6},
    }
    assert got.keys() == want.keys()
    for device, scopes in want.items():
        assert got[device] == pytest.approx(scopes)


def test_action_times_read_the_newest_trace_and_divide_by_steps(tmp_path):
    (tmp_path / "old").mkdir()
    for name, dur in (("old/a.trace.json.gz", 999.0), ("b.trace.json.gz", 40.0)):
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump({"traceEvents": [_event("dot.2", dur, device=0)]}, f)
    os.utime(tmp_path / "old" / "a.trace.json.gz", (1, 1))  # older than b
    schedule = zbjax.schedules.build("zb-h1", 2, 2)
    times = action_times(tmp_path, HLO, steps=2, schedule=schedule)
    assert list(times.seconds) == [0] and times.seconds[0] == pytest.approx({"W s0": 20e-6})
    assert times.runs == {"F s0": 2, "B s0": 2, "W s0": 2, "F s1": 2, "B s1": 2, "W s1": 2}
    assert times.per_run("W s0") == pytest.approx(10e-6)
    assert times.action_seconds(0) == pytest.approx(20e-6)
    costs = zbjax.schedules.Costs(f=(1.0, 2.0), b=(3.0, 4.0), w=(5.0, 6.0), bw=(7.0, 8.0))
    assert [scope_cost(costs, s) for s in ("F s1", "B s0", "W s1", "BW s0")] == [2, 3, 6, 7]
    # Planning by the step's times: W s0's time per run (40 us over 2 steps, 2 runs a step)
    # replaces the base's, and the actions with no op in this step (F s0, B s0, B s1, W s1)
    # took none; F s1, with ops but never traced, keeps the base's.
    replanned = times.costs(costs)
    assert replanned.w == pytest.approx((10e-6, 0.0)) and replanned.f == (0.0, 2.0)
    assert replanned.b == (0.0, 0.0) and replanned.bw == (7.0, 8.0)
    assert times.costs(zbjax.schedules.Costs(comm=0.5)).bw is None  # b + w, as before
    assert times.costs(zbjax.schedules.Costs(comm=0.5)).comm == 0.5
    # A profile with stage 0 fused and stage 1 split: BW s0 is taken, and with no fused time
    # given, stage 1's BW is its B + W, the in-step W included.
    runs = {"F s0": 1, "BW s0": 1, "F s1": 1, "B s1": 1, "W s1": 1}
    mixed = ActionTimes(1, {0: {"BW s0": 2.0}, 1: {"W s1": 3.0}}, runs)
    got = mixed.costs(zbjax.schedules.Costs(f=(1.0, 2.0), b=(3.0, 4.0), w=(5.0, 6.0)))
    assert got.w == (5.0, 3.0) and got.bw == (2.0, 7.0)
    with pytest.raises(zbjax.PipelineError, match="no fused backward"):
        scope_cost(zbjax.schedules.Costs(f=(1.0,), b=(1.0,), w=(1.0,)), "BW s0")
    with pytest.raises(zbjax.PipelineError, match="no event of action 'F s1'"):
        times.per_run("F s1")  # it has ops in the step, but the trace holds none of them
    # Four actions have no op in this compiled step (as a first stage's B has none): no time.
    assert times.empty == {"F s0", "B s0", "B s1", "W s1"}
    assert times.per_run("B s0") == 0.0
    with pytest.raises(zbjax.PipelineError, match="device 1 ran no 'W s0'; devices \\[0\\] did"):
        times.per_run("W s0", device=1)
    with pytest.raises(zbjax.PipelineError, match="takes the base Costs"):
        times.costs(None)
    with pytest.raises(zbjax.PipelineError, match=r"no device 7 in the trace; it holds \[0\]"):
        times.action_seconds(7)
    with pytest.raises(zbjax.PipelineError, match="no \\*.trace.json.gz"):
        action_times(tmp_path / "empty", HLO, 1, schedule)
    with pytest.raises(zbjax.PipelineError, match="no event of module"):
        action_times(tmp_path, HLO.replace("jit_step", "jit_other"), 1, schedule)


def test_profile_times_every_action_of_the_step_on_the_device_that_runs_it(tmp_path):
    cfg = mlp.MLPConfig(in_dim=16, width=32, depth=4, out_dim=8, stage_boundaries=(1,))
    params = mlp.init_params(jax.random.key(0), cfg)
    batch = mlp.make_batch(jax.random.key(1), cfg, 16)
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(mlp.make_loss_fn(cfg), mesh=mesh, schedule="zb-h1", num_microbatches=2)
    times = pipe.profile(params, batch, steps=1, trace_dir=str(tmp_path))
    assert list(tmp_path.rglob("*.trace.json.gz"))  # kept where asked
    assert times.runs == action_runs(pipe.schedule)
    for scope in times.runs:
        stage = int(scope.split(" s")[1])
        device = jax.devices()[pipe.schedule.placement[stage]].id
        assert times.seconds[device][scope] > 0, (scope, times.seconds)
        assert times.per_run(scope, device) > 0
    assert times.step_seconds > 0
    assert "device 0: actions" in times.table()
    # zb-h1 runs every B and W split: the in-step costs take all of F, B, W from the trace.
    in_step = times.costs(zbjax.schedules.Costs(comm=1e-3))
    for kind, got in (("F", in_step.f), ("B", in_step.b), ("W", in_step.w)):
        assert got == pytest.approx(tuple(times.per_run(f"{kind} s{s}") for s in range(2)))
    assert in_step.bw is None and in_step.comm == 1e-3
    with pytest.raises(zbjax.PipelineError, match="steps=0"):
        pipe.profile(params, batch, steps=0)
    # A trace_dir that cannot be a directory is named before any step runs (the profiler
    # failed as it stopped, and stayed running for every later profile).
    (tmp_path / "a_file").write_text("")
    for bad in ("a_file", "a_file/sub"):
        with pytest.raises(zbjax.PipelineError, match="trace_dir=.*a_file"):
            pipe.profile(params, batch, steps=1, trace_dir=str(tmp_path / bad))
    jax.profiler.start_trace(str(tmp_path / "users"))
    try:
        with pytest.raises(zbjax.PipelineError, match="already running"):
            pipe.profile(params, batch, steps=1)
    finally:
        jax.profiler.stop_trace()


def test_actions_keep_the_source_lines_of_the_users_code_in_the_compiled_step():
    """The stage programs are rebuilt from the user's jaxpr; their ops keep the user's source
    lines (not the interpreter's that rebuilt them), so an HLO dump, a profile or an error
    points at the model's code."""

    def loss_fn(w, x):
        h = jnp.tanh(x @ w)
        h = zbjax.stage_boundary(h)
        return jnp.mean(jnp.sin(h @ w))

    first = loss_fn.__code__.co_firstlineno
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h1", num_microbatches=2)
    hlo = pipe.lower(jnp.eye(4) / 2, jnp.ones((4, 4))).compile().as_text()
    frames = trace._stack_frames(hlo)
    where = collections.defaultdict(set)
    for line in hlo.splitlines():
        op = re.search(r'op_name="[^"]*/((?:F|B|W) s\d)/[^"]*?(tanh|sin)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        if op and frame:
            where[op.groups()].add(frames.get(int(frame.group(1))))
    assert where[("F s0", "tanh")] == {f"{__file__}:{first + 1} in {loss_fn.__qualname__}"}
    assert where[("F s1", "sin")] == {f"{__file__}:{first + 3} in {loss_fn.__qualname__}"}
    # The actions' ops are still placed by their action's scope.
    assert {"F s0", "F s1", "B s1", "W s0", "W s1"} <= set(hlo_ops(hlo).scope.values())
