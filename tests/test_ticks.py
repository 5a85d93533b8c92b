"""Tick tables: lockstep timing, slot allocation and message routing of a schedule (no JAX)."""

import pytest

from zbjax import schedules
from zbjax.errors import ScheduleError
from zbjax.schedules import Action, Schedule
from zbjax.ticks import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    PACKING_SLACKS,
    MessageEdge,
    choose_ticks,
    decode_actions,
    fuse_backward,
    incoming_messages,
    lockstep_ticks,
    outgoing_messages,
    pack_ticks,
    plan_ticks,
    tick_tables,
    tick_time,
)

NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")


def build(name: str, num_devices: int, num_microbatches: int) -> Schedule:
    stages = 2 * num_devices if name in ("zb-v", "interleaved-1f1b") else num_devices
    return schedules.build(name, stages, num_microbatches, num_devices=num_devices)


def replay(tables, schedule: Schedule, kept: bool = True, until_weight: bool = False) -> None:
    """Replays the tables' reads and writes and asserts every read finds the right data.

    Residual slots hold ("res", stage, mb) after F, kept slots ("kept", stage, mb) after F,
    stash slots ("stash", stage, mb) after B; message slots hold (edge, mb, direction). A read
    that finds anything else means two live items shared a slot or a message went to the wrong
    place. ``kept``: every stage has kept slots (else every kept index is the spare one);
    ``until_weight``: W reads the residual slot too (else its residual read is the spare).
    """
    kinds = schedules.backward_kinds(schedule)
    d_count = tables.num_devices
    residual = [dict() for _ in range(d_count)]
    kept_slots = [dict() for _ in range(d_count)]
    stash = [dict() for _ in range(d_count)]
    inbox = [dict() for _ in range(d_count)]
    for t in range(tables.num_ticks):
        arrivals = []
        for d in range(d_count):
            kind = int(tables.kind[t, d])
            s, i = int(tables.stage[t, d]), int(tables.microbatch[t, d])
            packed = [
                (int(tables.weight_stage[t, d, j]), int(tables.weight_microbatch[t, d, j]), j)
                for j in range(tables.num_weight_lanes)
                if tables.weight_stage[t, d, j] >= 0
            ]
            if kind == IDLE:
                assert tables.residual_write[t, d] == tables.num_residual_slots
                assert tables.kept_write[t, d] == tables.num_kept_slots
                assert tables.stash_write[t, d] == tables.num_stash_slots
                assert not packed, "a weight lane runs on a device whose main lane idles"
                continue
            backward = kind in (BACKWARD_INPUT, BACKWARD)
            if kind != BACKWARD_WEIGHT:
                for j, e in enumerate(incoming_messages(tables.edges, s, backward)):
                    slot = int(tables.message_read[t, d, j])
                    assert inbox[d].get(slot) == (e, i, backward), (t, d, s, i, j)
            if kind in (BACKWARD_INPUT, BACKWARD):
                assert residual[d].get(int(tables.residual_read[t, d])) == ("res", s, i)
            if kind == BACKWARD_WEIGHT:
                assert stash[d].get(int(tables.stash_read[t, d])) == ("stash", s, i)
                if until_weight:
                    assert residual[d].get(int(tables.residual_read[t, d])) == ("res", s, i)
                else:
                    assert tables.residual_read[t, d] == tables.num_residual_slots
            if kind != FORWARD:
                if kept:
                    assert kept_slots[d].get(int(tables.kept_read[t, d])) == ("kept", s, i)
                else:
                    assert tables.kept_read[t, d] == tables.num_kept_slots
            if kind == FORWARD:
                slot = int(tables.residual_write[t, d])
                assert slot < tables.num_residual_slots
                residual[d][slot] = ("res", s, i)
                if kept:
                    slot = int(tables.kept_write[t, d])
                    assert slot < tables.num_kept_slots
                    kept_slots[d][slot] = ("kept", s, i)
                else:
                    assert tables.kept_write[t, d] == tables.num_kept_slots
            if kind == BACKWARD_INPUT:
                slot = int(tables.stash_write[t, d])
                assert slot < tables.num_stash_slots
                stash[d][slot] = ("stash", s, i)
            if kind != BACKWARD_WEIGHT:
                for shift, position, e in outgoing_messages(
                    tables.edges, tables.placement, d_count, s, backward
                ):
                    arrivals.append(((d + shift) % d_count, shift, position, (e, i, backward)))
            # The weight lanes run after the main action, in lane order, on the same buffers.
            for ws, wi, j in packed:
                assert kinds[(ws, wi)] == "B", "a packed W whose stage runs a fused BW"
                assert stash[d].get(int(tables.weight_stash_read[t, d, j])) == ("stash", ws, wi)
                if until_weight:
                    got = residual[d].get(int(tables.weight_residual_read[t, d, j]))
                    assert got == ("res", ws, wi)
                else:
                    assert tables.weight_residual_read[t, d, j] == tables.num_residual_slots
                if kept:
                    got = kept_slots[d].get(int(tables.weight_kept_read[t, d, j]))
                    assert got == ("kept", ws, wi)
                else:
                    assert tables.weight_kept_read[t, d, j] == tables.num_kept_slots
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
        n = schedule.num_stages
        whole = tick_tables(schedule, kept=[False] * n, residuals_until_weight=[True] * n)
        replay(whole, schedule, kept=False, until_weight=True)


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


@pytest.mark.parametrize("name", NAMES)
def test_packed_tables_replay_and_decode_to_the_schedule(name):
    packed = 0
    for devices, micro in ((2, 2), (2, 6), (4, 8)):
        schedule = build(name, devices, micro)
        costs = costs_for(schedule, PACKING_COSTS)
        tables = tick_tables(schedule, positions=choose_ticks(schedule, costs))
        assert decode_actions(tables) == schedule.actions
        replay(tables, schedule)
        n = schedule.num_stages
        whole = tick_tables(
            schedule,
            kept=[False] * n,
            residuals_until_weight=[True] * n,
            positions=choose_ticks(schedule, costs),
        )
        replay(whole, schedule, kept=False, until_weight=True)
        packed += int((tables.weight_stage >= 0).sum())
        if name in ("gpipe", "1f1b", "interleaved-1f1b"):
            assert tables.num_weight_lanes == 0  # no separate W to pack
    if name in ("zb-h1", "zb-h2", "zb-v"):
        assert packed > 0, "these costs leave room for W in some ticks"
    assert tick_tables(build(name, 4, 8)).num_weight_lanes == 0  # no costs: no packing


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v"])
@pytest.mark.parametrize("slack", PACKING_SLACKS)
def test_pack_ticks_keeps_order_dependencies_and_tick_length(name, slack):
    schedule = build(name, 4, 8)
    costs = costs_for(schedule, PACKING_COSTS)
    position = pack_ticks(schedule, costs, slack)
    kinds = schedules.backward_kinds(schedule)
    for program in schedule.actions:
        # Every device runs its own actions in its own order.
        assert sorted(program, key=position.__getitem__) == list(program)
    for action, (tick, lane) in position.items():
        assert lane == 0 or action.kind == "W"
        for dep in schedules.dependencies(schedule, action, kinds):
            if action.kind == "W" and lane:
                assert position[dep] < (tick, lane)  # its B: earlier, or this tick's main lane
            else:
                assert position[dep][0] < tick
    busy, longest = {}, {}
    for action, (tick, lane) in position.items():
        key = (tick, schedule.placement[action.stage])
        busy[key] = busy.get(key, 0.0) + costs.of(action, schedule.num_stages)
        if lane == 0:
            longest[tick] = max(longest.get(tick, 0.0), costs.of(action, schedule.num_stages))
    for (tick, _), seconds in busy.items():
        assert seconds <= longest[tick] * (1 + slack) + 1e-9


PROFILE_1_5B = schedules.Costs(f=18522.0, b=18086.0, w=9337.0, comm=601.0)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v"])
@pytest.mark.parametrize("costs", [PACKING_COSTS, PROFILE_1_5B], ids=["cheap-b0", "1.5B"])
def test_chosen_packing_is_never_predicted_slower_than_lockstep(name, costs):
    for devices, micro in ((2, 4), (4, 8), (4, 16)):
        schedule = build(name, devices, micro)
        c = costs_for(schedule, costs)
        plain = tick_time(schedule, pack_ticks(schedule), c)
        assert tick_time(schedule, choose_ticks(schedule, c), c) <= plain


def test_packing_brings_zb_h2_lockstep_time_to_the_simulated_makespan():
    # The paper's 1.5B profile (without its comm, which ticks pay once each and the simulator
    # only on cross-device waits) on 4 devices, m = 8: one action per tick takes 6.8% longer
    # than the simulated step; W packed into the ticks' spare time closes the gap to 0.6%.
    costs = schedules.Costs(f=18522.0, b=18086.0, w=9337.0)
    schedule = build("zb-h2", 4, 8)
    makespan = schedules.simulate(schedule, costs).makespan
    plain = tick_time(schedule, pack_ticks(schedule), costs)
    chosen = choose_ticks(schedule, costs)
    assert plain > 1.06 * makespan
    assert tick_time(schedule, chosen, costs) < 1.01 * makespan
    assert max(t for t, _ in chosen.values()) < max(t for t, _ in pack_ticks(schedule).values())


#: Stage costs of step_time's MLP on one core each (benchmarks/multiprocess.py): the first
#: stage's B computes nothing (0.1 ms), its W the whole backward.
ONE_CORE_COSTS = schedules.Costs((3.65, 2.34), (0.10, 2.31), (4.55, 2.92), 0.78)


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


def test_plan_ticks_fuses_an_empty_backward_only_when_the_ticks_get_shorter():
    for m in (4, 8, 16):
        schedule = build("zb-h1", 2, m)
        planned, positions = plan_ticks(schedule, ONE_CORE_COSTS, [0])
        # One near-empty B tick per microbatch less on device 0: 9-11 % shorter here.
        assert planned.actions == fuse_backward(schedule, [0]).actions
        assert positions == choose_ticks(planned, ONE_CORE_COSTS)
        before = tick_time(schedule, choose_ticks(schedule, ONE_CORE_COSTS), ONE_CORE_COSTS)
        after = tick_time(planned, positions, ONE_CORE_COSTS)
        assert after < 0.93 * before
    schedule = build("zb-h1", 2, 4)
    assert plan_ticks(schedule, None, [0])[0] is schedule  # no costs: the schedule as built
    assert plan_ticks(schedule, ONE_CORE_COSTS, [])[0] is schedule  # no empty backward
    one_f_one_b = build("1f1b", 2, 4)
    assert plan_ticks(one_f_one_b, ONE_CORE_COSTS, [0])[0] is one_f_one_b  # nothing split
