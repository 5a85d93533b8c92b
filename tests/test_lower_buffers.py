"""The lowered step keeps its slot pools in place, and W's stash follows the memory model.

XLA copies a buffer that a multi-way conditional, or a branch reading and writing it, passes
through; in the tick loop that would copy every residual slot (or the message pool) on every
tick. These tests compile real pipelines and look for such copies in the optimized HLO.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

import zbjax
from models import gpt, mlp
from zbjax.lower import branch_keys, exchange_sizes, slot_layout
from zbjax.partition import partition
from zbjax.split import forwarded_stash, split
from zbjax.ticks import KIND_NAMES

CFG = mlp.MLPConfig(in_dim=16, width=32, depth=4, out_dim=8, stage_boundaries=(1,))


#: A 2-stage GPT on which zb-h2 at m = 4 keeps W's inputs in kept slots (see below).
GPT_CFG = gpt.GPTConfig(
    vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2, stage_boundaries=(0,)
)


#: Stage costs under which zb-h2 on 2 stages packs actions into lanes (a first stage with a
#: nearly free B and a long W, as measured on the MLP).
PACKING_COSTS = zbjax.schedules.Costs(f=(1.84, 2.14), b=(0.09, 1.81), w=(2.60, 1.77))


def _compiled_text(
    schedule: str, microbatches: int, model: str = "mlp", costs=None
) -> tuple[str, zbjax.Pipeline]:
    module, cfg = (mlp, CFG) if model == "mlp" else (gpt, GPT_CFG)
    params = module.init_params(jax.random.key(0), cfg)
    batch = module.make_batch(jax.random.key(1), cfg, (8 if model == "mlp" else 2) * microbatches)
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(
        module.make_loss_fn(cfg),
        mesh=mesh,
        schedule=schedule,
        num_microbatches=microbatches,
        costs=costs,
    )
    staged = pipe.stage(params, batch)
    return pipe.lower(staged, batch).compile().as_text(), pipe


#: ``zbjax.lower.SLOT_CANDIDATES`` with W's stash in stash slots only, or over B's residuals only.
STASH_SLOTS = tuple(c for c in zbjax.lower.SLOT_CANDIDATES if not c[1])
OVERLAID = tuple(c for c in zbjax.lower.SLOT_CANDIDATES if c[1])


@pytest.mark.parametrize(
    "schedule, model, packed, slots",
    [
        ("1f1b", "mlp", False, "any"),
        ("zb-h1", "mlp", False, "any"),
        ("zb-h2", "mlp", False, "any"),
        ("zb-h2", "gpt", False, "stash"),
        ("zb-h2", "gpt", True, "stash"),
        ("zb-h2", "gpt", False, "overlay"),
        ("zb-h2", "gpt", True, "overlay"),
        ("zb-h2", "gpt", False, "shared"),
        ("zb-h2", "gpt", True, "shared"),
    ],
)
def test_no_slot_pool_is_copied_in_the_compiled_step(schedule, model, packed, slots, monkeypatch):
    candidates = {"stash": STASH_SLOTS, "overlay": OVERLAID, "shared": STASH_SLOTS}.get(slots)
    if candidates:
        monkeypatch.setattr(zbjax.lower, "SLOT_CANDIDATES", candidates)
        # One arena buffer for every group (B writes where it reads) or one per group.
        monkeypatch.setattr(zbjax.lower, "ARENA_SHARING", (slots == "shared",))
    text, pipe = _compiled_text(schedule, 4, model, PACKING_COSTS if packed else None)
    low = pipe.lowering
    tables = low.tables
    assert (tables.num_packed > 0) == packed  # packed lanes read and write pools too
    # The residual, kept and stash arenas, one flat buffer per dtype each.
    pools = {
        "[{},{}]".format(*low.arenas.shape(b, k))
        for b, sizes in enumerate(low.arenas.sizes)
        for k, n in enumerate(sizes)
        if n
    }
    assert pools
    # The message pool too: each exchange writes what arrives into it in place.
    message_slots = tables.num_message_slots + 1
    pools |= {f"[{message_slots},{c}]" for c in low.message_capacity if c}
    if slots == "stash":
        assert tables.num_kept_slots and sum(low.kept_capacity)  # all three pools in use
        assert tables.num_stash_slots and sum(low.stash_capacity)
        assert len(low.arenas.sizes) == 3 and all(any(sizes) for sizes in low.arenas.sizes)
    if slots == "overlay":  # B writes W's stash over its residual slot
        assert any(low.overlay_capacity) and not any(low.stash_capacity)
        assert len(low.arenas.sizes) == 3 and not any(low.arenas.sizes[2])
    if slots == "shared":  # B writes W's stash into the buffer it reads its residuals from
        assert low.arenas.shared and tables.num_stash_slots
    # Copies in the entry computation run once per step (XLA may merge the pools' identical
    # initial values and copy one); the tick loop's body and its branches must copy none.
    loop_text = text[: text.index("\nENTRY ")]
    copies = re.findall(r"= \w+(\[[0-9,]+\])\{[^}]*\} copy\(", loop_text)
    copied_pools = [shape for shape in copies if shape in pools]
    assert not copied_pools, f"pool buffers copied per tick: {copied_pools} (pools {pools})"


@pytest.mark.parametrize("schedule, packed", [("1f1b", False), ("zb-h2", False), ("zb-h2", True)])
def test_every_action_runs_before_the_ticks_ppermute(schedule, packed):
    # An action that sends nothing (W, the last stage's F) must not be scheduled after the
    # tick's collective: it would then run in the next tick, while the other devices wait.
    text, pipe = _compiled_text(schedule, 4, costs=PACKING_COSTS if packed else None)
    tables = pipe.lowering.tables
    assert (tables.num_packed > 0) == packed
    # One conditional per (kind, stage) each lane runs.
    main = [(KIND_NAMES[k], s) for k, s in branch_keys(tables, 0)[1:]]
    if not packed:
        assert sorted(main) == sorted(pipe_actions(schedule))
    expected = sum(len(branch_keys(tables, lane)) - 1 for lane in range(tables.num_lanes))
    loop_text = text[: text.index("\nENTRY ")]
    computations = re.split(r"\n(?=\S)", loop_text)
    # Some ticks send nothing, so the ppermute sits in a conditional of its own (taken in the
    # ticks that exchange): a branch computation holding the collective-permute.
    assert not tables.exchanges.all()
    permuting = {c.split()[0] for c in computations if " collective-permute(" in c}

    def exchanges(line: str) -> bool:
        return " collective-permute(" in line or (
            " conditional(" in line
            and any(f"{name}," in line or f"{name}}}" in line for name in permuting)
        )

    bodies = [
        c for c in computations if " conditional(" in c and any(map(exchanges, c.splitlines()))
    ]
    assert len(bodies) == 1, "expected one tick body holding the conditionals and the exchange"
    lines = bodies[0].splitlines()
    permutes = [i for i, line in enumerate(lines) if exchanges(line)]
    conds = [i for i, line in enumerate(lines) if " conditional(" in line and i not in permutes]
    # One exchange per shift: a plain ppermute when every tick sends all its messages, else one
    # conditional per size the tick's exchange can have (the sizes are tables.exchanges' codes).
    sizes = exchange_sizes(tables)
    always = tables.exchanges.all(axis=0)
    expected_exchanges = sum(
        1 if always[k] and sizes[k] == (tables.messages_per_shift[k],) else len(sizes[k])
        for k, shift in enumerate(tables.shifts)
        if shift
    )
    assert len(permutes) == expected_exchanges, (permutes, sizes)
    assert len(conds) == expected, (conds, schedule)
    assert max(conds) < min(permutes), "an action is scheduled after the tick's ppermute"


def pipe_actions(schedule: str) -> list:
    """The (kind, stage) pairs the 2-stage pipeline of CFG runs: one conditional each."""
    kinds = ("F", "BW") if schedule in ("gpipe", "1f1b") else ("F", "B", "W")
    return [(k, s) for k in kinds for s in range(2)]


def _transposed_slot_reads(text: str, scope: str) -> list[list[str]]:
    """Returns, per fusion in ``scope`` ("W s1") that both reads a slot (a dynamic slice) and
    transposes, the shapes of its parameters."""
    bodies = {c.split(" ", 1)[0][1:]: c for c in re.split(r"\n(?=%\S+ \()", text)}
    found = []
    for line in text.splitlines():
        m = re.search(r"fusion\(.*calls=%([\w.\-]+).*op_name=\"[^\"]*/" + scope + r"[/\"]", line)
        body = bodies.get(m.group(1), "") if m else ""
        if "transpose(" in body and "dynamic-slice(" in body:
            found.append(re.findall(r"= (\w+\[[0-9,]+\])\S* parameter\(", body))
    return found


@pytest.mark.parametrize("apart", [True, False])
def test_w_reads_the_stash_b_wrote_without_transposing_the_slot_read_on_cpu(apart, monkeypatch):
    # XLA:CPU fuses a slot read into a transpose and emits that as an untiled strided loop,
    # 5x slower than its transpose of a whole buffer. JAX's weight gradient of ``x @ w`` over
    # (batch, seq) contracts two dimensions, for which XLA transposes the stashed cotangent;
    # the split merges them into one (``merge_contracting_dims``), so W's matmuls transpose no
    # slot read, whether or not the lowering also reads W's stash inside a conditional
    # (``read_apart``, on CPU; without it, the platform list emptied).
    monkeypatch.setattr(zbjax.lower, "SLOT_CANDIDATES", STASH_SLOTS)
    # The stash in a buffer of its own, so that its reads are told apart from the residuals'.
    monkeypatch.setattr(zbjax.lower, "ARENA_SHARING", (False,))
    if not apart:
        monkeypatch.setattr(zbjax.lower, "STASH_READS_APART", ())
    assert zbjax.lower.reads_stash_apart(jax.devices()[:2]) == apart
    text, pipe = _compiled_text("zb-h1", 4, "gpt")
    low = pipe.lowering
    stash_pools = {
        f"f32[1,{n}]"
        for n, dtype in zip(low.arenas.sizes[2], low.slot_dtypes, strict=True)
        if n and dtype == "float32"
    }
    assert stash_pools
    assert "dynamic-slice(" in text and "W s1" in text  # what the search below looks for
    reads = [shapes for s in (0, 1) for shapes in _transposed_slot_reads(text, f"W s{s}")]
    from_stash = [shapes for shapes in reads if stash_pools & set(shapes)]
    assert not from_stash, from_stash


def test_w_reads_the_residuals_it_needs_where_f_stored_them_and_b_copies_none():
    params = mlp.init_params(jax.random.key(0), CFG)
    microbatch = mlp.make_batch(jax.random.key(1), CFG, 8)
    programs = split(partition(mlp.make_loss_fn(CFG), params, microbatch))
    for program in programs:
        layout = slot_layout(program)
        stored = [
            int(np.prod(a.shape))
            for a, (where, _) in zip(program.residual_avals, layout.residuals, strict=True)
            if where in ("residual", "kept")
        ]
        assert sum(layout.residual_sizes) + sum(layout.kept_sizes) == sum(stored)
        # A stash value that is a residual is read where F stored it: B writes into the stash
        # only what it computes (the weight matmuls' output cotangents).
        forwarded = forwarded_stash(program)
        for f, source in zip(forwarded, layout.stash, strict=True):
            assert source == layout.residuals[f] if f is not None else source[0] == "stash"
        # The kept slot holds only what W reads; the rest is in the residual slot, free at B.
        read_by_w = {source for source in layout.stash if source[0] == "kept"}
        assert read_by_w == {source for source in layout.residuals if source[0] == "kept"}
        assert layout.has_kept
    first, last = programs
    # The last stage's B needs the activations' derivatives (tanh'), which W does not: they
    # stay in the residual slot, free at B. whole=True keeps that slot until W instead.
    assert sum(slot_layout(last).residual_sizes) > 0
    everything = slot_layout(last, whole=True)
    assert sum(everything.kept_sizes) == 0 and everything.weight_reads_residuals
    assert sum(everything.residual_sizes) == sum(slot_layout(last).kept_sizes) + sum(
        slot_layout(last).residual_sizes
    )
    # The first stage has no input cotangent to compute: W reads (nearly) every residual, so
    # the per-stage rule keeps its whole residual slot until W; the last stage's it splits.
    assert slot_layout(first, whole=None).weight_reads_residuals
    assert not slot_layout(last, whole=None).weight_reads_residuals


def test_the_step_allocates_the_kept_pool_the_tables_count(monkeypatch):
    # On a 2-stage GPT, zb-h2 keeps more microbatches between F and W than between F and B,
    # so the kept pool (only what W reads, until W) holds fewer bytes than whole residual slots
    # kept until W; the step runs with it and matches value_and_grad.
    cfg = GPT_CFG
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 8)
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    loss_fn = gpt.make_loss_fn(cfg)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=4)
    monkeypatch.setattr(zbjax.lower, "SLOT_CANDIDATES", STASH_SLOTS)
    loss, grads = pipe.value_and_grad(params, batch)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads
    )
    low = pipe.lowering
    tables = low.tables
    assert tables.num_kept_slots > tables.num_residual_slots > 0
    assert tables.num_stash_slots > 0 and sum(low.kept_capacity) > 0
    pool_bytes = sum(
        int(np.prod(a.shape[2:])) * np.dtype(a.dtype).itemsize for a in low.pool_avals()
    )
    assert pool_bytes == low.slot_pool_bytes()


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zb-v", "zb-auto"])
def test_one_arena_shared_by_residuals_kept_and_stash_gives_value_and_grad(schedule, monkeypatch):
    # Shared, B reads its residuals from the buffer it writes W's stash into, and a stash may
    # go where another microbatch's residuals lay; the step must still match value_and_grad.
    monkeypatch.setattr(zbjax.lower, "ARENA_SHARING", (True,))
    cfg = (
        GPT_CFG
        if schedule != "zb-v"
        else dataclasses.replace(GPT_CFG, num_layers=4, stage_boundaries=(0, 1, 2))
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 12)
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    loss_fn = gpt.make_loss_fn(cfg)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule=schedule, num_microbatches=6)
    loss, grads = pipe.value_and_grad(params, batch)
    assert pipe.lowering.arenas.shared
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads
    )


def test_an_arena_past_what_int32_indices_address_is_cut_into_rows(monkeypatch):
    # int32 indices address at most 2**31 elements of a flat arena; past that the arena is
    # rows no item crosses. A limit of 12000 elements per row makes this model take several.
    monkeypatch.setattr(zbjax.ticks, "ARENA_BANK", 12000)
    params = gpt.init_params(jax.random.key(0), GPT_CFG)
    batch = gpt.make_batch(jax.random.key(1), GPT_CFG, 12)
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    loss_fn = gpt.make_loss_fn(GPT_CFG)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=6)
    loss, grads = pipe.value_and_grad(params, batch)
    shapes = [a.shape for a in pipe.lowering.pool_avals()]
    assert any(rows > 1 for _, _, rows, _ in shapes), shapes
    assert all(length <= 12000 for *_, length in shapes)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads
    )
    # One microbatch's data of a stage larger than a row: no layout fits, and the error says
    # what to change.
    monkeypatch.setattr(zbjax.ticks, "ARENA_BANK", 100)
    small = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=6)
    with pytest.raises(zbjax.ScheduleError, match="more than int32 indices address"):
        small.stage(params, batch)


def _mlp_on_two_devices():
    """Returns (params, batch of 16 rows, 2-device mesh, loss_fn) of the MLP ``CFG``."""
    params = mlp.init_params(jax.random.key(0), CFG)
    batch = mlp.make_batch(jax.random.key(1), CFG, 16)
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    return params, batch, mesh, mlp.make_loss_fn(CFG)


def test_kept_buffers_give_the_same_step_twice_and_under_jit():
    params, batch, mesh, loss_fn = _mlp_on_two_devices()

    def make(keep):
        return zbjax.pipeline(
            loss_fn, mesh=mesh, schedule="zb-h1", num_microbatches=2, keep_buffers=keep
        )

    fresh, kept = make(False), make(True)
    assert kept.keep_buffers and not fresh.keep_buffers
    assert make(None).keep_buffers  # a CPU mesh keeps them by default
    want_loss, want_grads = fresh.value_and_grad(params, batch)
    for _ in range(2):  # the second call runs on the slots the first one donated back
        loss, grads = kept.value_and_grad(params, batch)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads, want_grads)
    assert len(kept._pools) == 1
    loss, _ = jax.jit(kept.value_and_grad)(params, batch)  # traced: allocates its own slots
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)


@pytest.mark.parametrize("costs", [None, PACKING_COSTS])
def test_w_stash_written_over_b_residuals_gives_value_and_grad(costs, monkeypatch):
    # B leaves W's stash in its own residual slot, after W's residuals; with packing, W may
    # read it in the tick B wrote it.
    params = gpt.init_params(jax.random.key(0), GPT_CFG)
    batch = gpt.make_batch(jax.random.key(1), GPT_CFG, 8)
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    loss_fn = gpt.make_loss_fn(GPT_CFG)
    monkeypatch.setattr(zbjax.lower, "SLOT_CANDIDATES", OVERLAID)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=4, costs=costs)
    loss, grads = pipe.value_and_grad(pipe.stage(params, batch), batch)
    low = pipe.lowering
    assert any(low.overlay_capacity) and not low.slot_bytes()[2]
    assert (low.tables.num_packed > 0) == (costs is not None)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        pipe.unstage(grads),
        want_grads,
    )


def test_buffers_donated_to_a_user_jit_run_the_step_in_place():
    params, batch, mesh, loss_fn = _mlp_on_two_devices()
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=2)
    staged = pipe.stage(params, batch)
    buffers = pipe.init_buffers(staged, batch)
    assert isinstance(buffers, zbjax.Buffers) and buffers.pools
    assert buffers.nbytes == pipe.lowering.slot_pool_bytes() * 2  # both devices' rows

    def step(staged, batch, buffers):
        loss, grads, buffers = pipe.value_and_grad(staged, batch, buffers=buffers)
        return loss, grads, buffers

    jitted = jax.jit(step, donate_argnums=2)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    for _ in range(2):  # the second step runs in the pools the first one returned
        given = buffers
        loss, grads, buffers = jitted(staged, batch, buffers)
        assert all(p.is_deleted() for p in given.pools if p.size)  # empty pools are not passed
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            pipe.unstage(grads),
            want_grads,
        )
    # The pools are the step's inputs and outputs, aliased: the program allocates none.
    with_buffers = jitted.lower(staged, batch, buffers).compile().memory_analysis()
    assert with_buffers.alias_size_in_bytes == pipe.lowering.slot_pool_bytes()
    plain = jax.jit(pipe.value_and_grad).lower(staged, batch).compile().memory_analysis()
    assert plain.alias_size_in_bytes == 0
    assert (
        plain.temp_size_in_bytes - with_buffers.temp_size_in_bytes
        >= pipe.lowering.slot_pool_bytes()
    )


def test_buffers_outside_jit_and_ahead_of_time_and_bad_buffers():
    params, batch, mesh, loss_fn = _mlp_on_two_devices()
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h1", num_microbatches=2)
    want_loss, _ = jax.value_and_grad(loss_fn)(params, batch)
    buffers = pipe.init_buffers(params, batch)
    loss, _, returned = pipe.value_and_grad(params, batch, buffers=buffers)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    with pytest.raises(zbjax.PipelineError, match="donated to an earlier step"):
        pipe.value_and_grad(params, batch, buffers=buffers)
    # Another pipeline's buffers on other devices: JAX's "incompatible devices" before.
    elsewhere = jax.make_mesh(mesh.devices.shape, mesh.axis_names, devices=jax.devices()[2:4])
    other = zbjax.pipeline(loss_fn, mesh=elsewhere, schedule="zb-h1", num_microbatches=2)
    with pytest.raises(zbjax.PipelineError, match="buffers lie on other devices"):
        pipe.value_and_grad(params, batch, buffers=other.init_buffers(params, batch))
    compiled = pipe.lower(params, batch, buffers=returned).compile()
    loss, _, returned = compiled(params, batch, None, returned)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert isinstance(returned, zbjax.Buffers)
    with pytest.raises(zbjax.PipelineError, match="takes the Buffers"):
        pipe.value_and_grad(params, batch, buffers=list(returned.pools))
    other = mlp.make_batch(jax.random.key(1), CFG, 32)
    with pytest.raises(zbjax.PipelineError, match="init_buffers"):
        pipe.value_and_grad(params, other, buffers=returned)


@pytest.mark.parametrize("schedule, devices", [("zb-h2", 4), ("zb-v", 2), ("zb-h1", 4)])
def test_layouts_not_packed_for_their_floor_change_nothing_the_lowering_takes(
    schedule, devices, monkeypatch
):
    # _slots_and_tables packs a layout only when its floor (the most bytes alive at once) is
    # below the best packed of its kind; packing every layout must take the same one.
    cfg = dataclasses.replace(GPT_CFG, num_layers=4, stage_boundaries=(0, 1, 2))
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 16)
    mesh = jax.make_mesh((devices,), ("pp",), devices=jax.devices()[:devices])
    pipe = zbjax.pipeline(gpt.make_loss_fn(cfg), mesh=mesh, schedule=schedule, num_microbatches=8)
    pipe.stage(params, batch)
    low = pipe.lowering
    args = (pipe.programs, low.slot_dtypes, low.schedule, pipe.graph)
    packs = []
    real_arenas = zbjax.lower.arenas
    monkeypatch.setattr(
        zbjax.lower, "arenas", lambda *a, **k: packs.append(1) or real_arenas(*a, **k)
    )
    layouts, tables, _, arena = zbjax.lower._slots_and_tables(*args)
    pruned = len(packs)
    floor = zbjax.lower.arena_floor
    monkeypatch.setattr(
        zbjax.lower, "arena_floor", lambda *a, **k: tuple((0,) * len(n) for n in floor(*a, **k))
    )
    packs.clear()
    every = zbjax.lower._slots_and_tables(*args)
    assert len(packs) > pruned  # the floors spared some packing
    assert every[0] == layouts
    assert (every[1].num_residual_slots, every[1].num_kept_slots, every[1].num_stash_slots) == (
        tables.num_residual_slots,
        tables.num_kept_slots,
        tables.num_stash_slots,
    )
    assert every[3].sizes == arena.sizes and every[3].group_buffer == arena.group_buffer
    assert (every[3].offsets == arena.offsets).all()
    assert arena.sizes == low.arenas.sizes  # what the pipeline took


@pytest.mark.parametrize("types", ["explicit", "mixed", "auto"])
def test_a_jitted_step_compiles_once_for_the_arenas_it_returns(types):
    # init_buffers spelled the arenas' sharding P("pp", "dp") where the step returns
    # P("pp", "dp", None, None) on an all-Explicit mesh: jit compiled the step a second time.
    E, A = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    axis_types = {"explicit": (E, E), "mixed": (E, A), "auto": (A, A)}[types]
    mesh = jax.make_mesh((2, 2), ("pp", "dp"), axis_types=axis_types, devices=jax.devices()[:4])
    params = mlp.init_params(jax.random.key(0), CFG)
    batch = mlp.make_batch(jax.random.key(1), CFG, 16)
    pipe = zbjax.pipeline(mlp.make_loss_fn(CFG), mesh=mesh, schedule="zb-h1", num_microbatches=2)
    staged = pipe.stage(params, batch)

    @jax.jit
    def step(staged, buffers):
        loss, _, buffers = pipe.value_and_grad(staged, batch, buffers=buffers)
        return loss, buffers

    buffers = pipe.init_buffers(staged, batch)
    for _ in range(2):
        loss, buffers = step(staged, buffers)
    assert step._cache_size() == 1
    np.testing.assert_allclose(loss, pipe.value_and_grad(params, batch)[0], rtol=1e-6)
