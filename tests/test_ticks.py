"""Tick tables: lockstep timing, slot allocation and message routing of a schedule (no JAX)."""

import dataclasses
import functools
import itertools

import numpy as np
import pytest

from zbjax import schedules
from zbjax import ticks as ticks_module
from zbjax.errors import ScheduleError
from zbjax.schedules import Action, Schedule
from zbjax.ticks import (
    ARENA_GROUPS,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    IDLE,
    KIND_NAMES,
    PACKINGS,
    PHASES,
    MessageEdge,
    arena_floor,
    arenas,
    barrier_time,
    choose_ticks,
    decode_actions,
    exchange_messages,
    exchange_ticks,
    fuse_backward,
    incoming_messages,
    lockstep_ticks,
    outgoing_messages,
    pack_intervals,
    pack_ticks,
    plan_ticks,
    segment_ticks,
    tick_tables,
    tick_time,
)

NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")


def build(name: str, num_devices: int, num_microbatches: int) -> Schedule:
    stages = 2 * num_devices if name in ("zb-v", "interleaved-1f1b") else num_devices
    return schedules.build(name, stages, num_microbatches, num_devices=num_devices)


def replay(tables, schedule: Schedule) -> None:
    """Replays the tables' messages and asserts every read finds the right one.

    Message slots hold (edge, mb, direction); a read that finds anything else means two live
    messages shared a slot or a message went to the wrong place. A tick's actions run by
    PHASES; messages arrive after all. (Where residuals and stashes lie, the arenas, is
    replayed by ``test_arena_items_alive_at_once_on_a_device_never_overlap``.)
    """
    kinds = schedules.backward_kinds(schedule)
    d_count = tables.num_devices
    inbox = [dict() for _ in range(d_count)]
    for t in range(tables.num_ticks):
        arrivals = []
        for d in range(d_count):
            busy = [int(tables.kind[t, d, lane]) != IDLE for lane in range(tables.num_lanes)]
            assert busy == sorted(busy, reverse=True), "a lane runs after an idle one"
            # As the lowering runs them: kind by kind (PHASES), lanes in order within a kind.
            order = sorted(
                range(tables.num_lanes),
                key=lambda lane: (
                    PHASES.get(KIND_NAMES.get(int(tables.kind[t, d, lane])), 0),
                    lane,
                ),
            )
            for lane in order:
                at = (t, d, lane)
                kind = int(tables.kind[at])
                s, i = int(tables.stage[at]), int(tables.microbatch[at])
                if kind == IDLE:
                    assert not tables.send_position[at].any()
                    continue
                if kind == BACKWARD_WEIGHT:
                    assert kinds[(s, i)] == "B", "a W whose stage runs a fused BW"
                    continue
                backward = kind in (BACKWARD_INPUT, BACKWARD)
                for j, e in enumerate(incoming_messages(tables.edges, s, backward)):
                    slot = int(tables.message_read[at + (j,)])
                    assert inbox[d].get(slot) == (e, i, backward), (t, d, lane, s, i, j)
                for j, (shift, _, e) in enumerate(
                    outgoing_messages(tables.edges, tables.placement, d_count, s, backward)
                ):
                    position = int(tables.send_position[at + (j,)])
                    arrivals.append(((d + shift) % d_count, shift, position, (e, i, backward)))
        sent = [(dst, shift, position) for dst, shift, position, _ in arrivals]
        assert len(set(sent)) == len(sent), "two messages share a payload position in a tick"
        for dst, shift, position, message in arrivals:
            k = tables.shifts.index(shift)
            slot = int(tables.message_write[t, dst, k, position])
            assert slot < tables.num_message_slots
            inbox[dst][slot] = message
    assert len(kinds) == schedule.num_stages * schedule.num_microbatches


@pytest.mark.parametrize("name", NAMES)
def test_tables_decode_to_the_schedule_action_for_action(name):
    schedule = build(name, 4, 8)
    tables = tick_tables(schedule)
    assert decode_actions(tables) == schedule.actions


@pytest.mark.parametrize("name", NAMES)
def test_every_read_finds_its_data_when_the_tables_are_replayed(name):
    for devices, micro in ((2, 2), (4, 8)):
        schedule = build(name, devices, micro)
        replay(tick_tables(schedule), schedule)


def test_residual_slots_free_at_b_and_kept_slots_at_w():
    schedule = build("zb-h2", 4, 16)
    tables = tick_tables(schedule)
    # W runs late in zb-h2: more microbatches sit between F and W than between F and B.
    assert tables.num_kept_slots > tables.num_residual_slots
    assert tables.num_stash_slots > 0
    whole = tick_tables(schedule, kept=[False] * 4, residuals_until_weight=[True] * 4)
    assert whole.num_kept_slots == 0
    assert whole.num_residual_slots == tables.num_kept_slots
    fused = tick_tables(build("1f1b", 4, 16))
    assert fused.num_stash_slots == 0
    assert fused.num_kept_slots == fused.num_residual_slots


@pytest.mark.parametrize("name", NAMES)
def test_with_lives_counts_what_tables_built_with_those_lives_count(name):
    # The lowering builds the tables once and weighs each layout's lives by with_lives.
    schedule = build(name, 4, 8)
    n = schedule.num_stages
    plain = tick_tables(schedule)
    for kept, until_weight in (
        ([False] * n, [True] * n),
        ([s % 2 == 0 for s in range(n)], [s % 3 == 0 for s in range(n)]),
    ):
        built = tick_tables(schedule, kept=kept, residuals_until_weight=until_weight)
        counted = ticks_module.with_lives(plain, kept, until_weight)
        for field in ("num_residual_slots", "num_kept_slots", "num_stash_slots"):
            assert getattr(counted, field) == getattr(built, field), field
        assert counted.action_times == built.action_times
        assert (counted.kind == plain.kind).all() and counted.edges == plain.edges
    assert tick_tables(schedule, kept=[False] * n).num_kept_slots == 0


def test_lockstep_ticks_run_each_action_after_all_its_dependencies():
    schedule = build("zb-h1", 4, 8)
    ticks = lockstep_ticks(schedule)
    kinds = schedules.backward_kinds(schedule)
    for action, tick in ticks.items():
        for dep in schedules.dependencies(schedule, action, kinds):
            assert ticks[dep] < tick
    for program in schedule.actions:
        assert [ticks[a] for a in program] == sorted(ticks[a] for a in program)


def test_zb_h1_takes_3m_plus_p_minus_1_ticks_and_1f1b_2m_plus_2p_minus_2():
    p, m = 4, 8
    assert tick_tables(build("zb-h1", p, m)).num_ticks == 3 * m + p - 1
    # 1F1B's backward is the fused BW, one tick in lockstep.
    assert tick_tables(build("1f1b", p, m)).num_ticks == 2 * m + 2 * (p - 1)


def test_residual_slots_follow_microbatches_in_flight_not_m():
    p = 4
    for m in (8, 32):
        assert tick_tables(build("1f1b", p, m)).num_residual_slots == p
        assert tick_tables(build("zb-h1", p, m)).num_residual_slots == p
        assert tick_tables(build("gpipe", p, m)).num_residual_slots == m


def test_v_placement_sends_both_ways_and_copies_locally():
    tables = tick_tables(build("zb-v", 4, 8))
    # Shift 0 is the local copy between the two chunks on the last device, 1 and 3 (= -1)
    # carry activations down and back up the V.
    assert tables.shifts == (0, 1, 3)


def test_fan_out_and_fan_in_edges_get_one_message_each():
    edges = (MessageEdge(0, 1), MessageEdge(0, 2), MessageEdge(1, 3), MessageEdge(2, 3))
    actions = [[] for _ in range(4)]
    m = 3
    for s in range(4):
        actions[s] += [Action("F", s, i) for i in range(m)]
        actions[s] += [Action("BW", s, i) for i in reversed(range(m))]
    schedule = Schedule(
        "dag-gpipe", 4, m, (0, 1, 2, 3), actions, edges=[(e.src, e.dst) for e in edges]
    )
    tables = tick_tables(schedule, edges)
    assert decode_actions(tables) == schedule.actions
    assert outgoing_messages(edges, tables.placement, 4, 0, backward=False) == (
        (1, 0, 0),
        (2, 0, 1),
    )
    assert incoming_messages(edges, 3, backward=False) == (2, 3)
    replay(tables, schedule)


def test_action_on_the_wrong_device_is_rejected():
    schedule = build("1f1b", 2, 2)
    programs = [list(p) for p in schedule.actions]
    programs[0][0] = Action("F", 1, 0)
    with pytest.raises(ScheduleError, match="placement rule"):
        lockstep_ticks(schedule.with_actions(programs))


def test_deadlocked_order_is_rejected():
    schedule = build("gpipe", 2, 2)
    programs = [list(p) for p in schedule.actions]
    programs[1] = programs[1][::-1]  # backward before its forward
    with pytest.raises(ScheduleError, match="deadlock"):
        lockstep_ticks(schedule.with_actions(programs))


#: Costs under which W packs into some ticks of every zero-bubble schedule: a first stage with
#: a cheap B (it has no input gradient to compute) and a long W, as a real first stage has.
PACKING_COSTS = schedules.Costs(
    f=(1.0, 1.2) + (1.0,) * 6, b=(0.1,) + (1.0,) * 7, w=(1.5,) + (1.0,) * 7
)


def costs_for(schedule: Schedule, costs: schedules.Costs) -> schedules.Costs:
    f, b, w = costs.per_stage(8)
    n = schedule.num_stages
    return schedules.Costs(f[:n], b[:n], w[:n], costs.comm)


#: Step_time's 2-stage MLP measured on this machine (ms): a first stage whose B computes
#: nothing, a second whose F and B are as long as its W.
TWO_STAGE_COSTS = schedules.Costs((1.8, 1.95), (0.1, 1.8), (2.6, 1.75))


def packing_costs(schedule: Schedule) -> schedules.Costs:
    """PACKING_COSTS on 4 devices, TWO_STAGE_COSTS on 2 (halved per chunk for 2 per device)."""
    if schedule.num_devices == 4:
        return costs_for(schedule, PACKING_COSTS)
    per_device = schedule.num_stages // schedule.num_devices
    f, b, w = (tuple(x / per_device for x in v for _ in range(per_device)) for v in
               TWO_STAGE_COSTS.per_stage(2))  # fmt: skip
    return schedules.Costs(f, b, w)


@pytest.mark.parametrize("name", NAMES)
def test_packed_tables_replay_and_decode_to_the_schedule(name):
    packed: dict[str, int] = {}
    for devices, micro in ((2, 2), (2, 6), (4, 8)):
        schedule = build(name, devices, micro)
        costs = packing_costs(schedule)
        n = schedule.num_stages
        candidates = [choose_ticks(schedule, costs)] + [
            pack_ticks(schedule, costs, slack, lanes, kinds)
            for kinds, lanes in PACKINGS
            for slack in (0.0, 0.5, 2.0)
        ]
        for positions in candidates:
            tables = tick_tables(schedule, positions=positions)
            assert decode_actions(tables) == schedule.actions
            replay(tables, schedule)
            replay_arenas(schedule, tables, [True] * n, [False] * n)
            whole = tick_tables(
                schedule,
                kept=[False] * n,
                residuals_until_weight=[True] * n,
                positions=positions,
            )
            replay_arenas(schedule, whole, [False] * n, [True] * n)
            for action, (_, lane) in positions.items():
                if lane:
                    packed[action.kind] = packed.get(action.kind, 0) + 1
    if name in ("zb-h1", "zb-h2", "zb-v"):
        assert packed.get("W", 0) > 0, "these costs leave room for W in some ticks"
    assert set(packed) - {"W"}, f"these costs leave room for more than W in some ticks: {packed}"
    assert tick_tables(build(name, 4, 8)).num_lanes == 1  # no costs: no packing


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("packing", PACKINGS, ids=["w-1", "any-1", "any-2"])
@pytest.mark.parametrize("slack", [0.0, 0.3, 2.0])
@pytest.mark.parametrize("share", [False, True], ids=["own-shift", "share"])
def test_pack_ticks_keeps_order_dependencies_sends_and_tick_length(name, packing, slack, share):
    kinds_packed, lanes = packing
    for devices, micro in ((2, 6), (4, 8)):
        schedule = build(name, devices, micro)
        costs = packing_costs(schedule)
        position = pack_ticks(schedule, costs, slack, lanes, kinds_packed, share)
        kinds = schedules.backward_kinds(schedule)
        for program in schedule.actions:
            # Every device runs its own actions in its own order, one per (tick, lane).
            places = [position[a] for a in program]
            assert places == sorted(places) and len(set(places)) == len(places)
        for action, (tick, lane) in position.items():
            assert lane <= lanes and (lane == 0 or action.kind in kinds_packed)
            for dep in schedules.dependencies(schedule, action, kinds):
                if lane and dep.stage == action.stage:
                    assert position[dep] < (tick, lane)  # its own stage: earlier, or this tick
                else:
                    assert position[dep][0] < tick  # messages move at the end of a tick
        busy, longest, shifts = {}, {}, {}
        for action, (tick, lane) in position.items():
            device = schedule.placement[action.stage]
            busy[tick, device] = busy.get((tick, device), 0.0) + costs.of(action, len(costs.f))
            if lane == 0:
                longest[tick] = max(longest.get(tick, 0.0), costs.of(action, len(costs.f)))
            if action.kind != "W":
                sends = outgoing_messages(
                    [MessageEdge(a, b) for a, b in schedule.edges],
                    schedule.placement,
                    devices,
                    action.stage,
                    action.kind != "F",
                )
                for shift, _, _ in sends:
                    shared = (tick, device, shift) in shifts
                    assert share or not shared, "two sends over one shift"
                    shifts[tick, device, shift] = action
        for (tick, _), seconds in busy.items():
            assert seconds <= longest[tick] * (1 + slack) + 1e-9
        # Messages sent over one shift in one tick take distinct positions of its payload and
        # reach their readers.
        tables = tick_tables(schedule, positions=position)
        replay(tables, schedule)
        if not share:
            assert max(tables.messages_per_shift) == 1


def test_tables_refuse_positions_that_run_an_action_before_its_data():
    schedule = build("zb-h1", 2, 2)
    positions = pack_ticks(schedule)
    # F of stage 1 in the tick its input is sent: it would read a message not there yet.
    early = dict(positions)
    early[Action("F", 1, 0)] = positions[Action("F", 0, 0)]
    with pytest.raises(ScheduleError, match="whose data is not there yet"):
        tick_tables(schedule, positions=early)
    swapped = dict(positions)
    a, b = schedule.actions[0][:2]
    swapped[a], swapped[b] = positions[b], positions[a]
    with pytest.raises(ScheduleError, match="schedule's order"):
        tick_tables(schedule, positions=swapped)
    missing = dict(positions)
    del missing[Action("W", 0, 1)]
    with pytest.raises(ScheduleError, match="give every action"):
        tick_tables(schedule, positions=missing)


def test_two_sends_over_one_shift_in_a_tick_share_its_exchange():
    # zb-v on 2 devices: device 0 holds stages 0 and 3, and F of stage 0 and B of stage 3 both
    # send over shift 1. Order B of stage 3 right after an F of stage 0 and put it in that F's
    # tick, in lane 1: its data is there (its stage's F ran before), and its message takes the
    # payload's next position.
    schedule = build("zb-v", 2, 4)
    program = list(schedule.actions[0])
    f0, b3 = Action("F", 0, 3), Action("B", 3, 2)
    program.remove(b3)
    program.insert(program.index(f0) + 1, b3)
    schedule = schedule.with_actions([program, list(schedule.actions[1])])
    alone = tick_tables(schedule, positions=pack_ticks(schedule))
    positions = pack_ticks(schedule)
    tick = positions[f0][0]
    positions[b3] = (tick, 1)
    tables = tick_tables(schedule, positions=positions)
    replay(tables, schedule)
    assert decode_actions(tables) == schedule.actions
    k = tables.shifts.index(1)
    assert tables.send_position[tick, 0, 0, 0] == 0  # F of stage 0 first, in lane 0
    assert tables.send_position[tick, 0, 1, 0] == 1  # then B of stage 3, in lane 1
    assert tables.messages_per_shift[k] == 2 and alone.messages_per_shift[k] == 1
    assert tables.payload_blocks[tick, k] == 2
    # Every other tick moves at most one position, and one exchange fewer is needed.
    assert (np.delete(tables.payload_blocks[:, k], tick) <= 1).all()
    assert tables.exchanges.sum() == alone.exchanges.sum() - 1


PROFILE_1_5B = schedules.Costs(f=18522.0, b=18086.0, w=9337.0, comm=601.0)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v"])
@pytest.mark.parametrize("costs", [PACKING_COSTS, PROFILE_1_5B], ids=["cheap-b0", "1.5B"])
def test_chosen_packing_is_never_predicted_slower_than_plain_ticks(name, costs):
    for devices, micro in ((2, 4), (4, 8), (4, 16)):
        schedule = build(name, devices, micro)
        c = costs_for(schedule, costs)
        plain = barrier_time(schedule, pack_ticks(schedule), c)
        assert barrier_time(schedule, choose_ticks(schedule, c), c) <= plain


def test_packing_brings_zb_h2_tick_time_to_the_simulated_makespan():
    # The paper's 1.5B profile (without its comm, which ticks pay once each and the simulator
    # only on cross-device waits) on 4 devices, m = 8: one action per tick takes 6.8% longer
    # than the simulated step when every tick waits for the slowest device, 4.8% when only
    # the exchanges do; packing the ticks' spare time closes the gap to under 1 %.
    costs = schedules.Costs(f=18522.0, b=18086.0, w=9337.0)
    schedule = build("zb-h2", 4, 8)
    makespan = schedules.simulate(schedule, costs).makespan
    chosen = choose_ticks(schedule, costs)
    assert tick_time(schedule, pack_ticks(schedule), costs) > 1.06 * makespan
    assert barrier_time(schedule, pack_ticks(schedule), costs) > 1.04 * makespan
    assert barrier_time(schedule, chosen, costs) < 1.01 * makespan
    assert max(t for t, _ in chosen.values()) < max(t for t, _ in pack_ticks(schedule).values())


def test_waiting_only_at_exchanges_brings_two_stage_ticks_to_the_simulated_makespan():
    # Step_time's MLP costs on 2 devices: one action per tick is 9-15 % above the simulated
    # step when every tick waits for the slowest device, but within 2 % when devices wait
    # only at the ticks that send a message (the lowering skips the others' ppermute), and
    # the planned ticks are within 1 % for every schedule, 1f1b included.
    for name in ("1f1b", "zb-h1", "zb-h2"):
        for m in (4, 8, 16):
            schedule = build(name, 2, m)
            makespan = schedules.simulate(schedule, TWO_STAGE_COSTS).makespan
            planned, positions = plan_ticks(schedule, TWO_STAGE_COSTS, [0])
            assert tick_time(schedule, pack_ticks(schedule), TWO_STAGE_COSTS) > 1.08 * makespan
            assert barrier_time(schedule, pack_ticks(schedule), TWO_STAGE_COSTS) < 1.02 * makespan
            assert barrier_time(planned, positions, TWO_STAGE_COSTS) < 1.01 * makespan


#: Stage costs of step_time's MLP on one core each (benchmarks/multiprocess.py): the first
#: stage's B computes nothing (0.1 ms), its W the whole backward.
ONE_CORE_COSTS = schedules.Costs((3.65, 2.34), (0.10, 2.31), (4.55, 2.92), 0.78)
#: Step_time's MLP measured by benchmarks/multiprocess.py on an AMD EPYC (ms), with its fused
#: backward: stage 1's B and W cost 10.19 against BW's 9.51.
ONE_CORE_COSTS_BW = schedules.Costs(
    (4.57, 4.96), (0.07, 4.41), (7.94, 5.78), 1.54, bw=(7.98, 9.51), comm_message=0.40
)


def test_fuse_backward_turns_a_stages_b_into_bw_in_place_and_drops_its_w():
    schedule = build("zb-h1", 2, 4)
    fused = fuse_backward(schedule, [0])
    for before, after in zip(schedule.actions, fused.actions, strict=True):
        expected = [
            Action("BW", a.stage, a.microbatch) if (a.kind, a.stage) == ("B", 0) else a
            for a in before
            if (a.kind, a.stage) != ("W", 0)
        ]
        assert list(after) == expected
    tables = tick_tables(fused, positions=choose_ticks(fused, ONE_CORE_COSTS))
    assert decode_actions(tables) == fused.actions
    replay(tables, fused)


def test_plan_ticks_fuses_an_empty_backward_only_when_the_ticks_get_no_longer():
    fused_at = []
    for m in (4, 8, 16):
        schedule = build("zb-h1", 2, m)
        fused = fuse_backward(schedule, [0])
        split_time = barrier_time(schedule, choose_ticks(schedule, ONE_CORE_COSTS), ONE_CORE_COSTS)
        fused_time = barrier_time(fused, choose_ticks(fused, ONE_CORE_COSTS), ONE_CORE_COSTS)
        planned, positions = plan_ticks(schedule, ONE_CORE_COSTS, [0])
        expected = fused if fused_time <= split_time else schedule
        assert planned.actions == expected.actions
        assert positions == choose_ticks(planned, ONE_CORE_COSTS)
        if planned.actions == fused.actions:
            fused_at.append(m)
        # Planning (packing, fusing) gains over 5 % on one action per device per tick.
        plain = barrier_time(schedule, pack_ticks(schedule), ONE_CORE_COSTS)
        assert min(split_time, fused_time) < 0.95 * plain
    # Segmented (``segment_ticks``), the fused schedule runs as fast as the split one at
    # every m (packing alone left the split faster at m = 4), so the fused one is kept.
    assert fused_at == [4, 8, 16]
    schedule = build("zb-h1", 2, 4)
    assert plan_ticks(schedule, None, [0])[0] is schedule  # no costs: the schedule as built
    assert plan_ticks(schedule, ONE_CORE_COSTS, [])[0] is schedule  # no empty backward
    one_f_one_b = build("1f1b", 2, 4)
    assert plan_ticks(one_f_one_b, ONE_CORE_COSTS, [0])[0] is one_f_one_b  # nothing split


#: Step_time's MLP measured on an Intel Xeon (ms): stage 1's B and W cost 5.08 against its
#: fused backward's 3.59, more than deferring W saves on two devices.
COSTLY_SPLIT = schedules.Costs((2.71, 2.88), (0.07, 2.63), (3.20, 2.45), bw=(3.13, 3.59))


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_plan_ticks_fuses_a_stage_whose_split_costs_more_than_it_saves(name):
    for m in (4, 8):
        schedule = build(name, 2, m)
        planned, positions = plan_ticks(schedule, COSTLY_SPLIT, [0])
        # Both stages run their backward whole: no W is left, and every B became a BW.
        assert planned.actions == fuse_backward(schedule, [0, 1]).actions
        assert positions == choose_ticks(planned, COSTLY_SPLIT)
        seconds = barrier_time(planned, positions, COSTLY_SPLIT)
        for kept in ([0], []):  # stage 1 split, with stage 0 fused or not
            other = fuse_backward(schedule, kept)
            assert seconds < barrier_time(other, choose_ticks(other, COSTLY_SPLIT), COSTLY_SPLIT)
        # Without the fused backward's time (BW costing B + W) no stage with a B is fused.
        plain = dataclasses.replace(COSTLY_SPLIT, bw=None)
        assert ("W", 1) in {
            (a.kind, a.stage) for a in plan_ticks(schedule, plain, [0])[0].actions[1]
        }
    # Where the split pays (the same MLP on an AMD EPYC, one core per device), it stays.
    planned, _ = plan_ticks(build(name, 2, 4), ONE_CORE_COSTS_BW, [0])
    assert ("W", 1) in {(a.kind, a.stage) for _, _, a in planned.all_actions()}


def test_plan_ticks_tries_many_costly_stages_fused_all_at_once(monkeypatch):
    # Eight stages whose B + W cost 1.9 against a fused 1.2: past FUSE_ONE_BY_ONE stages they
    # are tried fused together (one more plan, not seven), kept where that is shorter.
    costs = schedules.Costs(1.0, 1.0, 0.9, 0.05, bw=1.2)
    schedule = build("zb-h2", 8, 16)
    plans = []

    def counted(schedule, costs, segments=True):
        plans.append(segments)
        return choose_ticks(schedule, costs, segments)

    monkeypatch.setattr(ticks_module, "choose_ticks", counted)
    planned, positions = plan_ticks(schedule, costs, [0])
    # As built, the empty first stage fused, then the other seven too: three plans with the
    # segment search, and the same three without it (plan_ticks returns the faster).
    assert plans.count(True) == 3 and plans.count(False) == 3
    assert planned.actions == fuse_backward(schedule, range(8)).actions
    split = barrier_time(schedule, choose_ticks(schedule, costs), costs)
    assert barrier_time(planned, positions, costs) < 0.95 * split


# zb-auto's order on 2 stages at m = 8: fusing is greedy, and with the segment search its
# path ends slower (41.80) than without it (41.65).
GREEDY_COSTS = schedules.Costs(
    f=(1.96, 1.79), b=(1.25, 1.69), w=(1.61, 0.94), comm=0.22, bw=(2.51, 2.4)
)


def test_plan_ticks_is_never_slower_than_its_plan_without_the_segment_search():
    schedule = schedules.build("zb-auto", 2, 8, costs=GREEDY_COSTS)
    plan = plan_ticks(schedule, GREEDY_COSTS, [0])
    screened = plan_ticks(schedule, GREEDY_COSTS, [0], segments=False)
    searched_path = ticks_module._planned(schedule, GREEDY_COSTS, [0], True)
    assert barrier_time(*searched_path, GREEDY_COSTS) > barrier_time(*screened, GREEDY_COSTS)
    assert barrier_time(*plan, GREEDY_COSTS) == barrier_time(*screened, GREEDY_COSTS)
    # Without costs there is nothing to search: plain lockstep ticks either way.
    assert plan_ticks(schedule, None) == plan_ticks(schedule, None, segments=False)


def test_fastest_in_ticks_takes_the_candidate_whose_planned_ticks_are_shortest():
    names = ("zb-auto", "zb-h1", "zb-h2", "1f1b")
    candidates = [schedules.build(n, 2, 8, costs=GREEDY_COSTS) for n in names]
    fastest = ticks_module.fastest_in_ticks(candidates, GREEDY_COSTS, [0])
    full = [barrier_time(*plan_ticks(s, GREEDY_COSTS, [0]), GREEDY_COSTS) for s in candidates]
    screened = [
        barrier_time(*plan_ticks(s, GREEDY_COSTS, [0], segments=False), GREEDY_COSTS)
        for s in candidates
    ]
    # zb-h2's order wins in ticks where the search's (planned for event-driven time) loses.
    assert names[fastest.index] == "zb-h2" and full[2] < 0.97 * full[0]
    for i, time in enumerate(fastest.times):
        assert time == (full[i] if fastest.full[i] else screened[i])
        assert fastest.full[i] == (screened[i] <= min(screened) * 1.05)
    assert fastest.plan == plan_ticks(candidates[2], GREEDY_COSTS, [0])
    with pytest.raises(ScheduleError, match="no candidate"):
        ticks_module.fastest_in_ticks([], GREEDY_COSTS)


@pytest.mark.parametrize("name", NAMES)
def test_a_tick_exchanges_exactly_when_an_action_in_it_sends_to_another_device(name):
    schedule = build(name, 4, 8)
    positions = pack_ticks(schedule)
    tables = tick_tables(schedule, positions=positions)
    # Derived from the actions alone: F sends unless its stage is the last, B/BW unless it is
    # the first, and only a message to a stage on another device crosses devices.
    crossing = set()
    for action, (tick, _) in positions.items():
        if action.kind == "W":
            continue
        neighbour = action.stage + (1 if action.kind == "F" else -1)
        if 0 <= neighbour < schedule.num_stages and (
            schedule.placement[neighbour] != schedule.placement[action.stage]
        ):
            crossing.add(tick)
    assert exchange_ticks(schedule, positions) == crossing
    assert {t for t in range(tables.num_ticks) if tables.exchanges[t].any()} == crossing
    # Some ticks send nothing (the last W's at least); the lowering skips their ppermute.
    assert len(crossing) < tables.num_ticks
    for k, shift in enumerate(tables.shifts):
        assert shift != 0 or not tables.exchanges[:, k].any()


def test_barrier_time_waits_for_the_slowest_device_only_at_exchanges():
    # Two stages on two devices, one microbatch, costs F 1/2, B 3/4, W 5/6, comm 0.5.
    schedule = build("zb-h1", 2, 1)
    costs = schedules.Costs((1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 0.5)
    positions = pack_ticks(schedule)
    # Ticks: F0 | F1 | B1 | B0 and W1 | W0. F0 and B1 send (exchanges after ticks 0 and 2);
    # device 1 runs F1 then B1 (6), device 0 B0 then W0 (8) while device 1 runs W1 (6).
    assert exchange_ticks(schedule, positions) == {0, 2}
    assert barrier_time(schedule, positions, costs) == 1 + 0.5 + 6 + 0.5 + 8
    # Lockstep waits at every tick (and pays comm at each): 1 + 2 + 4 + 6 + 5 + 5 * 0.5.
    assert tick_time(schedule, positions, costs) == 1 + 2 + 4 + 6 + 5 + 5 * 0.5


#: Stage costs measured by benchmarks/multiprocess.py (ms: one core per device; the exchange
#: a gloo ppermute between two processes, 2.09 ms).
PROCESS_COSTS = schedules.Costs((4.51, 4.87), (0.06, 4.59), (8.71, 6.35), 2.09)


def fewest_segment_seconds(schedule: Schedule, costs: schedules.Costs, lanes: int) -> float:
    """Returns the least time of ``segment_ticks``'s model by trying every way of cutting the
    devices' programs into segments (exponential in the devices: for tiny schedules only)."""
    programs = schedule.actions
    sizes = tuple(len(p) for p in programs)
    kinds = schedules.backward_kinds(schedule)
    where = {a: (d, i) for d, p in enumerate(programs) for i, a in enumerate(p)}
    edges = [MessageEdge(a, b) for a, b in schedule.edges]

    def messages(action):
        # The shift of every message ``action`` sends to another device.
        if action.kind == "W":
            return []
        backward = action.kind != "F"
        return [s for s, _, _ in outgoing_messages(edges, schedule.placement,
                                                   schedule.num_devices, action.stage,
                                                   backward) if s]  # fmt: skip

    def most_messages(d, start, end):
        # The most messages device d's actions start..end send over one shift.
        shifts = [s for i in range(start, end) for s in messages(programs[d][i])]
        return max((shifts.count(s) for s in shifts), default=0)

    def runs(frontier, d):
        # Every run device d may take from frontier: (end, seconds, its senders).
        out, seconds, senders = [(frontier[d], 0.0, [])], 0.0, []
        for i in range(frontier[d], len(programs[d])):
            action = programs[d][i]
            needs = schedules.dependencies(schedule, action, kinds)
            if any(dep.stage != action.stage and where[dep][1] >= frontier[where[dep][0]]
                   for dep in needs):  # fmt: skip
                break
            if messages(action):
                senders = senders + [i]
            if senders and i - senders[0] >= lanes:
                break
            seconds += costs.of(action, schedule.num_stages)
            out.append((i + 1, seconds, senders))
        return out

    @functools.cache
    def best(frontier):
        if frontier == sizes:
            return 0.0
        options = []
        for picked in itertools.product(*(runs(frontier, d) for d in range(len(sizes)))):
            end = tuple(run[0] for run in picked)
            if end == frontier:
                continue
            exchange = any(senders for _, _, senders in picked)
            if not exchange and end != sizes:
                continue
            sent = max(most_messages(d, frontier[d], end[d]) for d in range(len(sizes)))
            comm = costs.exchange(sent) if exchange else 0.0
            options.append(max(run[1] for run in picked) + comm + best(end))
        return min(options, default=float("inf"))

    return best(tuple(0 for _ in sizes))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"])
def test_segment_ticks_find_the_fastest_segments_and_tables_that_run_them(name):
    # A second message in an exchange costing as much as the first (a bandwidth-bound link).
    bandwidth = dataclasses.replace(PROCESS_COSTS, comm_message=PROCESS_COSTS.comm)
    cases = ((2, PROCESS_COSTS), (2, bandwidth), (2, TWO_STAGE_COSTS), (2, ONE_CORE_COSTS))
    if name != "interleaved-1f1b":  # whose exhaustive search at m = 3 takes half a minute
        cases += ((3, TWO_STAGE_COSTS),)
    for micro, two_stage in cases:
        schedule = build(name, 2, micro)
        chunks = schedule.num_stages // 2  # a device's stage split in chunks, each as long
        f, b, w = (tuple(x / chunks for _ in range(chunks) for x in v)
                   for v in two_stage.per_stage(2))  # fmt: skip
        costs = schedules.Costs(f, b, w, two_stage.comm, comm_message=two_stage.comm_message)
        check_fewest_segments(schedule, costs)


def check_fewest_segments(schedule: Schedule, costs: schedules.Costs) -> None:
    """Asserts that ``segment_ticks`` places ``schedule`` in tables that run it, and as fast as
    the exhaustive search over segments says is least, with one lane and with three."""
    for lanes in (1, 3):
        positions = segment_ticks(schedule, costs, lanes)
        assert 1 + max(lane for _, lane in positions.values()) <= lanes
        tables = tick_tables(schedule, positions=positions)
        assert decode_actions(tables) == schedule.actions
        replay(tables, schedule)
        # Devices meet only at exchanges, each a segment's last tick: the ticks cost what the
        # exhaustive search over segments says is least.
        seconds = barrier_time(schedule, positions, costs)
        assert seconds == pytest.approx(fewest_segment_seconds(schedule, costs, lanes))
        assert seconds <= barrier_time(schedule, pack_ticks(schedule), costs) + 1e-9


def test_segment_ticks_beat_packing_where_exchanges_cost_and_choose_ticks_takes_them():
    # The multiprocess benchmark's costs: packing into fixed ticks leaves zb-h2 at 0.99x 1f1b
    # at m = 8, placing the exchanges first at 0.96x (the simulator's makespan: 0.91x).
    def planned_seconds(name, m):
        planned, positions = plan_ticks(build(name, 2, m), PROCESS_COSTS, [0])
        return barrier_time(planned, positions, PROCESS_COSTS)

    schedule = fuse_backward(build("zb-h2", 2, 8), [0])
    packed = min(
        barrier_time(schedule, pack_ticks(schedule, PROCESS_COSTS, slack, lanes, kinds),
                     PROCESS_COSTS)
        for kinds, lanes in PACKINGS
        for slack in ticks_module.PACKING_SLACKS
    )  # fmt: skip
    segmented = barrier_time(schedule, segment_ticks(schedule, PROCESS_COSTS), PROCESS_COSTS)
    assert segmented < 0.97 * packed
    assert choose_ticks(schedule, PROCESS_COSTS) == segment_ticks(schedule, PROCESS_COSTS)
    assert planned_seconds("zb-h2", 8) < 0.96 * planned_seconds("1f1b", 8)


def test_exchanges_are_charged_by_the_messages_their_largest_payload_carries():
    # Placing the exchanges first on zb-h2 sends two messages of a device in one exchange
    # where a second message is free; where it costs as much as the first (bandwidth-bound),
    # the same search sends fewer together.
    schedule = fuse_backward(build("zb-h2", 2, 4), [0])
    costs = dataclasses.replace(PROCESS_COSTS, comm=3.0)
    bandwidth = dataclasses.replace(costs, comm_message=3.0)
    free = segment_ticks(schedule, costs)
    messages = exchange_messages(schedule, free)
    assert set(messages) == exchange_ticks(schedule, free) and max(messages.values()) == 2
    # The tables the lowering runs carry as many messages in each exchange.
    blocks = tick_tables(schedule, positions=free).payload_blocks.max(axis=1)
    assert {t: int(n) for t, n in enumerate(blocks) if n} == messages
    extra = sum(n - 1 for n in messages.values())
    assert barrier_time(schedule, free, bandwidth) == pytest.approx(
        barrier_time(schedule, free, costs) + 3.0 * extra
    )
    apart = segment_ticks(schedule, bandwidth)
    assert sum(n - 1 for n in exchange_messages(schedule, apart).values()) < extra
    assert barrier_time(schedule, apart, bandwidth) < barrier_time(schedule, free, bandwidth)


def test_segment_ticks_skip_what_they_cannot_search(monkeypatch):
    schedule = build("zb-v", 2, 4)  # its V placement has an edge inside each device
    assert segment_ticks(schedule, costs_for(schedule, PACKING_COSTS)) is None
    assert segment_ticks(build("zb-h2", 1, 4), PACKING_COSTS) is None  # one device
    assert segment_ticks(build("zb-h2", 2, 8), PROCESS_COSTS) is not None
    monkeypatch.setattr(ticks_module, "SEGMENT_STATES", 100)
    assert segment_ticks(build("zb-h2", 2, 8), PROCESS_COSTS) is None  # 25 x 25 pairs


#: Uneven costs of four stages with an exchange: a first stage with a cheap B and a long W.
FOUR_STAGE_COSTS = schedules.Costs(
    (1.0, 1.2, 1.0, 1.1), (0.1, 1.0, 1.0, 0.9), (1.5, 0.6, 0.5, 0.7), 0.3
)


@pytest.mark.parametrize(
    "name, devices, micro",
    [("gpipe", 4, 4), ("1f1b", 4, 4), ("zb-h1", 4, 4), ("zb-h2", 4, 4), ("zb-h2", 3, 3),
     ("interleaved-1f1b", 3, 3), ("dag-zb", 4, 4)],
)  # fmt: skip
def test_segment_ticks_on_more_devices_find_the_fastest_segments(name, devices, micro):
    if name == "dag-zb":  # a diamond: stage 0 sends to stages 1 and 2 over two shifts
        edges = ((0, 1), (0, 2), (1, 3), (2, 3))
        schedule = schedules.build(name, 4, micro, edges=edges, placement=(0, 1, 2, 3))
    else:
        schedule = build(name, devices, micro)
    chunks = schedule.num_stages // devices
    f, b, w = (tuple(x / chunks for _ in range(chunks) for x in v[:devices])
               for v in FOUR_STAGE_COSTS.per_stage(4))  # fmt: skip
    # Where an exchange costs the same whatever it carries, the best-first search finds the
    # least time of every way of cutting the programs into segments.
    check_fewest_segments(schedule, schedules.Costs(f, b, w, FOUR_STAGE_COSTS.comm))


def test_choose_ticks_takes_segments_on_four_devices_where_they_pay():
    # The 1.5B profile of the Zero Bubble paper (F, B, W, comm in us): zb-h1's ticks packed
    # into lockstep run 10 % longer than the event-driven makespan; the exchanges placed first,
    # under 4 % longer.
    costs = schedules.Costs(18522, 18086, 9337, 601)
    schedule = build("zb-h1", 4, 8)
    makespan = schedules.simulate(schedule, costs).makespan
    packed = min(barrier_time(schedule, p, costs) for p in ticks_module.packings(schedule, costs))
    chosen = choose_ticks(schedule, costs)
    assert chosen == segment_ticks(schedule, costs)
    assert barrier_time(schedule, chosen, costs) < 1.04 * makespan < 0.95 * packed


def test_segment_search_on_more_devices_weights_its_estimate_then_gives_up(monkeypatch):
    schedule = build("zb-h2", 4, 8)
    costs = FOUR_STAGE_COSTS
    least = barrier_time(schedule, segment_ticks(schedule, costs), costs)
    # Past its first share of frontiers the search weights its estimate of the time left: it
    # ends sooner, at most that weight times the least time.
    monkeypatch.setattr(ticks_module, "SEGMENT_EXPANSIONS", 20)
    monkeypatch.setattr(ticks_module, "SEGMENT_WEIGHTS", (1.0, 3.0))
    weighted = segment_ticks(schedule, costs)
    assert weighted is not None
    assert least <= barrier_time(schedule, weighted, costs) <= 3.0 * least
    replay(tick_tables(schedule, positions=weighted), schedule)
    monkeypatch.setattr(ticks_module, "SEGMENT_WEIGHTS", (1.0,))
    assert segment_ticks(schedule, costs) is None


def _overlaps(placed):
    """Returns the pairs of (start, end, offset, size) that overlap in time and in memory."""
    return [
        (a, b)
        for a, b in itertools.combinations(placed, 2)
        if a[0] < b[1] and b[0] < a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]
    ]


def _most_alive(intervals, size_of):
    """Returns the largest total size of the intervals alive at one time."""
    return max(
        (sum(size_of(o) for s, e, o in intervals if s <= t < e) for t, _, _ in intervals),
        default=0,
    )


def test_packed_intervals_never_share_memory_while_both_live():
    rng = np.random.default_rng(0)
    for trial in range(30):
        starts = rng.integers(0, 40, size=25)
        intervals = [(int(s), int(s + rng.integers(1, 12)), j) for j, s in enumerate(starts)]
        sizes = {j: int(rng.choice([0, 3, 8, 20])) for j in range(25)}
        where, total = pack_intervals(intervals, sizes.__getitem__, align=4)
        padded = {j: -(-n // 4) * 4 for j, n in sizes.items()}
        placed = [(s, e, where[j], padded[j]) for s, e, j in intervals if padded[j]]
        assert not _overlaps(placed), trial
        assert all(where[j] % 4 == 0 for j in where)
        assert total == max((o + n for _, _, o, n in placed), default=0)
        assert total >= _most_alive(intervals, padded.__getitem__)
        # Never more than slots of the largest size, as many as are alive at once.
        counted = _most_alive(intervals, lambda j, padded=padded: 1 if padded[j] else 0)
        assert total <= counted * max(padded.values())


def test_packed_intervals_of_one_size_take_the_most_alive_at_once():
    # Equal sizes are placed like slots: exactly as many as are alive at one time.
    rng = np.random.default_rng(1)
    for _ in range(20):
        starts = rng.integers(0, 50, size=30)
        intervals = [(int(s), int(s + rng.integers(1, 15)), j) for j, s in enumerate(starts)]
        _, total = pack_intervals(intervals, lambda owner: 7)
        assert total == _most_alive(intervals, lambda owner: 7)


def test_first_fit_in_start_order_sweeps_to_the_same_offsets_as_checking_every_item():
    # The start-order sweep keeps only the items alive at each start; placing against every
    # item placed before (the general first fit) must give the same offsets, banks or not.
    rng = np.random.default_rng(2)
    for trial in range(200):
        n = int(rng.integers(1, 40))
        starts = rng.integers(0, 60, size=n)
        order = sorted(
            (int(s), int(s + rng.integers(1, 20)), j, int(rng.integers(1, 9)))
            for j, s in enumerate(starts)
        )
        bank = None if trial % 2 else int(rng.integers(9, 30))
        swept = ticks_module._first_fit_in_start_order(order, bank)
        assert swept == ticks_module._first_fit(order, bank), trial
        if bank is not None:
            for offset, (*_, size) in zip(swept, order, strict=True):
                assert offset // bank == (offset + size - 1) // bank


def _arena_sizes(name, p, m, big_first=10, big_last=(4, 5)):
    """Returns size_of for ``arenas``: stage 0 stores ``big_first`` residual elements that its
    W reads too, the last stage ``big_last`` kept and stash elements, others 1 of each."""
    last = {"residual": 2, "kept": big_last[0], "stash": big_last[1]}

    def size_of(group, stage, k, split):
        if group == "stash" and not split:
            return 0
        if stage == 0:
            return big_first if group == "residual" else 0
        return last[group] if stage == p - 1 else 1

    return size_of


#: Per arena group, the action kinds that write an item and those that may read it last.
ITEM_WRITTEN_BY = {"residual": "F", "kept": "F", "stash": "B"}


def replay_arenas(schedule, tables, kept, until_weight, limit=None) -> None:
    """Places ``tables``'s items in arenas (separate and shared, ``limit`` elements a row at
    most) and asserts every action finds its item where it was written and no two items a
    device holds at once overlap. ``kept[s]``, ``until_weight[s]``: stage ``s`` keeps
    residuals for W, its W reads its residuals (as ``tick_tables`` was built)."""
    n = schedule.num_stages
    size_of = _arena_sizes(schedule.name, n, schedule.num_microbatches)
    scheduled = {a for *_, a in schedule.all_actions()}
    for shared in (False, True):
        arena = arenas(
            tables, size_of, 1, kept, until_weight, align=[2], shared=shared, limit=limit
        )
        assert arena.shared == shared and len(arena.sizes) == (1 if shared else 3)
        floor = arena_floor(tables, size_of, 1, kept, until_weight, align=[2], shared=shared)
        assert all(f[0] <= n[0] for f, n in zip(floor, arena.sizes, strict=True))
        # Each item: (device, buffer) -> its offset, size and the times of the actions that
        # touch it (tick, phase, lane); it lives from its write to its last read.
        touched: dict = {}
        for (t, d, lane), code in np.ndenumerate(tables.kind):
            if code == IDLE:
                continue
            kind = KIND_NAMES[int(code)]
            s, i = int(tables.stage[t, d, lane]), int(tables.microbatch[t, d, lane])
            split = Action("W", s, i) in scheduled
            for g, group in enumerate(ARENA_GROUPS):
                size = -(-size_of(group, s, 0, split) // 2) * 2
                reads = kind != ITEM_WRITTEN_BY[group]
                if group == "residual" and kind == "W" and not until_weight[s]:
                    continue
                if group == "stash" and (kind in ("F", "BW") or not split):
                    continue
                if group == "kept" and not kept[s]:
                    continue
                key = (d, arena.group_buffer[g], group, s, i)
                offset = int(arena.offsets[t, d, lane, g, 0])
                item = touched.setdefault(key, [offset, size, []])
                assert item[0] == offset  # every action finds the item where it was written
                item[2].append(((t, PHASES[kind], lane), reads))
        lives = {}
        for key, (offset, size, times) in touched.items():
            assert sum(not reads for _, reads in times) == 1  # one write, then reads
            start = min(time for time, reads in times if not reads)
            end = max(time for time, _ in times)
            assert end > start
            lives[key] = (start, end, offset, size)
            if not size:
                continue  # counted below, but takes no room
            assert offset + size <= arena.sizes[key[1]][0]
            rows, length = arena.shape(key[1], 0)
            assert rows * length == arena.sizes[key[1]][0]
            assert offset // length == (offset + size - 1) // length < rows
            if limit is not None:
                assert length <= limit
        for a, b in itertools.combinations(lives, 2):
            if a[:2] != b[:2]:
                continue
            (s1, e1, o1, n1), (s2, e2, o2, n2) = lives[a], lives[b]
            in_time = s1 < e2 and s2 < e1
            in_space = n1 and n2 and o1 < o2 + n2 and o2 < o1 + n1
            assert not (in_time and in_space), (schedule.name, shared, a, b)
        # The tables count the most items of a kind a device holds at once.
        for g, count in enumerate(
            (tables.num_residual_slots, tables.num_kept_slots, tables.num_stash_slots)
        ):
            alive = [
                [live for key, live in lives.items() if key[0] == d and key[2] == ARENA_GROUPS[g]]
                for d in range(tables.num_devices)
            ]
            most = max(_most_alive([(x[0], x[1], None) for x in al], lambda _: 1) for al in alive)
            assert count == most, (ARENA_GROUPS[g], count, most)


@pytest.mark.parametrize("limit", [None, 24])
@pytest.mark.parametrize("name, m", [("zb-h2", 16), ("zb-h1", 8), ("zb-v", 8), ("1f1b", 8)])
def test_arena_items_alive_at_once_on_a_device_never_overlap(name, m, limit):
    # With a limit on a row's elements (int32 indices address 2**31), the arena is rows of
    # equal length and no item crosses from one row into the next.
    schedule = build(name, 4, m)
    n = schedule.num_stages
    until_weight = [True] + [False] * (n - 1)  # stage 0's W reads its residuals
    tables = tick_tables(schedule, residuals_until_weight=until_weight)
    replay_arenas(schedule, tables, [True] * n, until_weight, limit)


@pytest.mark.parametrize("name", NAMES)
def test_arena_items_never_overlap_for_every_schedule_with_or_without_kept_residuals(name):
    for devices, micro in ((2, 2), (4, 8)):
        schedule = build(name, devices, micro)
        n = schedule.num_stages
        replay_arenas(schedule, tick_tables(schedule), [True] * n, [False] * n)
        whole = tick_tables(schedule, kept=[False] * n, residuals_until_weight=[True] * n)
        replay_arenas(schedule, whole, [False] * n, [True] * n)


@pytest.mark.parametrize("name", NAMES)
def test_arena_floor_is_what_separate_arenas_of_one_item_size_take(name):
    # Items of one size per buffer pack like slots: exactly the most alive at once, the floor.
    schedule = build(name, 4, 8)
    n = schedule.num_stages
    tables = tick_tables(schedule)
    sizes = {"residual": 6, "kept": 4, "stash": 2}

    def size_of(group, stage, k, split):
        return sizes[group] if group != "stash" or split else 0

    floor = arena_floor(tables, size_of, 1, [True] * n, [False] * n, align=[2])
    packed = arenas(tables, size_of, 1, [True] * n, [False] * n, align=[2])
    assert floor == packed.sizes
    counts = (tables.num_residual_slots, tables.num_kept_slots, tables.num_stash_slots)
    assert floor == tuple((sizes[g] * c,) for g, c in zip(ARENA_GROUPS, counts, strict=True))


def test_one_shared_arena_holds_less_than_equal_slots_when_peaks_differ_by_device():
    # zb-h2 defers W: the last device holds many kept items and stashes, the first few but
    # large residuals. Equal slots take the largest item times the most in flight, per kind;
    # a shared arena takes what is alive at once on the busiest device.
    schedule = build("zb-h2", 4, 16)
    until_weight = [True, False, False, False]
    tables = tick_tables(schedule, residuals_until_weight=until_weight)
    size_of = _arena_sizes("zb-h2", 4, 16)
    shared = arenas(tables, size_of, 1, [True] * 4, until_weight, shared=True)
    separate = arenas(tables, size_of, 1, [True] * 4, until_weight)
    largest = {g: max(size_of(g, s, 0, True) for s in range(4)) for g in ARENA_GROUPS}
    slots = (
        largest["residual"] * tables.num_residual_slots
        + largest["kept"] * tables.num_kept_slots
        + largest["stash"] * tables.num_stash_slots
    )
    assert sum(n for (n,) in separate.sizes) <= slots
    assert shared.sizes[0][0] < 0.7 * slots
    assert shared.sizes[0][0] <= sum(n for (n,) in separate.sizes)


def test_arenas_past_a_rows_limit_take_rows_and_refuse_an_item_larger_than_a_row():
    schedule = build("zb-h2", 4, 16)
    tables = tick_tables(schedule)
    size_of = _arena_sizes("zb-h2", 4, 16)
    whole = arenas(tables, size_of, 1, [True] * 4, [False] * 4, shared=True)
    rows = arenas(tables, size_of, 1, [True] * 4, [False] * 4, shared=True, limit=24)
    assert whole.shape(0, 0)[0] == 1
    assert rows.shape(0, 0)[0] > 1 and rows.shape(0, 0)[1] <= 24
    row_of, within = rows.row_offsets()
    assert np.array_equal(row_of * rows.shape(0, 0)[1] + within, rows.offsets)
    with pytest.raises(ScheduleError, match="residual data of stage 0 takes 10 elements"):
        arenas(tables, size_of, 1, [True] * 4, [False] * 4, limit=8)
