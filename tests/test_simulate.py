"""simulate(): timing, bubble rate, memory, dependencies and deadlocks (pure Python)."""

import pytest

from zbjax.errors import ScheduleError
from zbjax.schedules import (
    Action,
    Costs,
    Schedule,
    backward_kinds,
    build,
    dependencies,
    memory_delta,
    parse_actions,
    peak_memory,
    simulate,
    span_bubble_rate,
)

A = Action.parse


def _chain(text: str, num_microbatches: int = 1, **kwargs) -> Schedule:
    actions = parse_actions(text)
    return Schedule("hand", len(actions), num_microbatches, range(len(actions)), actions, **kwargs)


def test_two_stage_timing_with_comm_only_between_devices():
    s = _chain("d0: 0F0 0B0 0W0\nd1: 1F0 1B0 1W0")
    r = simulate(s, Costs(f=1.0, b=2.0, w=0.5, comm=0.25))
    assert r.start[A("1F0")] == 1.25  # 0F0 ends at 1, plus comm
    assert r.start[A("1B0")] == 2.25  # same device: no comm after 1F0
    assert r.start[A("0B0")] == 4.5  # 1B0 ends at 4.25, plus comm
    assert r.end[A("0W0")] == r.makespan == 7.0
    assert r.busy == (3.5, 3.5)
    assert r.bubble_rate == pytest.approx(1 - 7.0 / (2 * 7.0))


def test_bubble_rate_is_one_minus_compute_over_devices_times_makespan():
    s = _chain("d0: 0F0 0BW0\nd1: 1F0 1BW0")
    r = simulate(s, Costs(f=1.0, b=1.0, w=1.0))
    # 0F0 [0,1] 1F0 [1,2] 1BW0 [2,4] 0BW0 [4,6]
    assert r.makespan == 6.0
    assert r.bubble_rate == pytest.approx(1 - 6.0 / (2 * 6.0))
    # Device 0's span is the whole 6 units (device 1's only 3): back-to-back steps repeat
    # every 6 units, so the span measure equals the plain one here.
    assert span_bubble_rate(s, r) == pytest.approx(1 - 6.0 / (2 * 6.0))


def test_per_stage_costs_are_used_per_stage():
    s = _chain("d0: 0F0 0BW0\nd1: 1F0 1BW0")
    r = simulate(s, Costs(f=[1.0, 3.0], b=[1.0, 2.0], w=[0.0, 1.0]))
    assert r.end[A("1F0")] == 4.0
    assert r.end[A("1BW0")] == 7.0
    assert r.end[A("0BW0")] == 8.0


def test_fused_backward_lasts_its_measured_cost_where_given():
    s = _chain("d0: 0F0 0BW0\nd1: 1F0 1BW0")
    r = simulate(s, Costs(f=[1.0, 3.0], b=[1.0, 2.0], w=[0.0, 1.0], bw=[0.5, 2.5]))
    assert r.end[A("1BW0")] == 6.5  # 1F0 ends at 4, then 2.5 (not b + w = 3)
    assert r.end[A("0BW0")] == 7.0


def test_default_costs_are_one_per_action_and_no_comm():
    r = simulate(build("gpipe", 2, 2))
    # F: 0F0 0F1 / 1F0 1F1 from t=1; BW costs 2.
    assert r.makespan == 3 * (2 + 2 - 1)


def test_deadlock_raises_naming_the_waiting_actions():
    s = _chain("d0: 0F0 0BW0 0F1 0BW1\nd1: 1F1 1F0 1BW0 1BW1", num_microbatches=2)
    with pytest.raises(ScheduleError, match="deadlock") as info:
        simulate(s)
    assert "device 0 waits at 0BW0" in str(info.value)
    assert "device 1 waits at 1F1" in str(info.value)


def test_a_dependency_nobody_runs_is_reported():
    s = _chain("d0: 0F0 0B0 0W0\nd1: 1B0 1W0")
    with pytest.raises(ScheduleError, match="1B0 on device 1 needs 1F0, which no device runs"):
        simulate(s)


def test_memory_delta_follows_the_contract():
    assert memory_delta(A("0F0"), 0.5) == 1.0
    assert memory_delta(A("0B0"), 0.25) == -0.75
    assert memory_delta(A("0W0"), 0.25) == -0.25
    assert memory_delta(A("0BW0"), 0.25) == -1.0


def test_peak_memory_is_per_device_and_uses_w_mem():
    text = "d0: 0F0 0F1 0B0 0F2 0W0 0B1 0W1 0B2 0W2\nd1: 1F0 1B0 1W0 1F1 1B1 1W1 1F2 1B2 1W2"
    assert peak_memory(_chain(text, 3, w_mem=0.5)) == (2.5, 1.0)
    assert peak_memory(_chain(text, 3, w_mem=1.0)) == (3.0, 1.0)
    assert simulate(_chain(text, 3)).peak_memory == (2.5, 1.0)


def test_dependencies_on_a_stage_dag_with_fused_and_split_backward():
    s = Schedule(
        "dag",
        4,
        1,
        (0, 1, 2, 3),
        parse_actions("0F0 0B0 0W0\n1F0 1BW0\n2F0 2B0 2W0\n3F0 3B0 3W0"),
        edges=((0, 1), (0, 2), (1, 3), (2, 3)),
    )
    assert backward_kinds(s) == {(0, 0): "B", (1, 0): "BW", (2, 0): "B", (3, 0): "B"}
    assert set(dependencies(s, A("3F0"))) == {A("1F0"), A("2F0")}
    assert set(dependencies(s, A("0B0"))) == {A("0F0"), A("1BW0"), A("2B0")}
    assert dependencies(s, A("2W0")) == (A("2B0"),)
    assert dependencies(s, A("0F0")) == ()
    r = simulate(s)
    assert r.start[A("3F0")] == 2.0
    assert r.start[A("0B0")] == max(r.end[A("1BW0")], r.end[A("2B0")])


def test_simulated_order_respects_every_dependency_on_generated_schedules():
    costs = Costs(f=1.0, b=1.5, w=0.7, comm=0.2)
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"):
        s = build(name, 8, 8)
        r = simulate(s, costs)
        for device, _, action in s.all_actions():
            for dep in dependencies(s, action):
                gap = costs.comm if s.placement[dep.stage] != device else 0.0
                assert r.start[action] >= r.end[dep] + gap - 1e-9, (name, action, dep)
        for program in s.actions:
            for before, after in zip(program, program[1:], strict=False):
                assert r.start[after] >= r.end[before] - 1e-9


def test_a_long_chain_simulates_in_time_linear_in_its_actions():
    """Sweeping every device until none moved took one pass per device of a backward wave,
    and each action's neighbours were found by scanning all edges: a 1f1b chain of 4000 stages
    took 21 s to build and simulate (41 s through zbjax schedule, helper Q1); now 0.2 s."""
    import time

    start = time.perf_counter()
    schedule = build("1f1b", 4000, 1)
    result = simulate(schedule)
    assert result.makespan == 3 * 4000
    assert time.perf_counter() - start < 15
