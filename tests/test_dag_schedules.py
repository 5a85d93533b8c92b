"""dag-1f1b and dag-zb: 1F1B and zero bubble on a stage DAG (pure Python, no JAX)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbjax.errors import ScheduleError
from zbjax.schedules import Costs, build, peak_memory, simulate, validate
from zbjax.schedules.dag import dag_1f1b, dag_zb, depth_to_sink, longest_span

DIAMOND = ((0, 1), (0, 2), (1, 3), (2, 3))
UNIT = Costs(1.0, 1.0, 1.0, 0.0)


def _fan_in(branches: int, depth: int = 1) -> tuple[tuple[int, int], ...]:
    """Returns edges of ``branches`` chains of ``depth`` stages all feeding one head stage."""
    head = branches * depth
    edges = []
    for b in range(branches):
        first = b * depth
        edges += [(first + k, first + k + 1) for k in range(depth - 1)]
        edges.append((first + depth - 1, head))
    return tuple(edges)


def _measures(schedule, costs=UNIT):
    run = simulate(schedule, costs)
    return run.makespan, longest_span(schedule, run)


def test_depth_to_sink_counts_stages_on_the_longest_path():
    assert depth_to_sink(4, DIAMOND) == (3, 2, 2, 1)
    assert depth_to_sink(5, ((0, 1), (1, 2), (2, 4), (3, 4))) == (4, 3, 2, 2, 1)


def test_diamond_on_four_devices_orders_fan_out_and_fan_in():
    s = validate(dag_1f1b(DIAMOND, (0, 1, 2, 3), 6, stage_names=("in", "a", "b", "out")))
    run = simulate(s, UNIT)
    for i in range(6):
        # Fan-in: the head's F waits for both branches; fan-out: the root's BW waits for both.
        assert run.start[_a("3F", i)] >= max(run.end[_a("1F", i)], run.end[_a("2F", i)])
        assert run.start[_a("0BW", i)] >= max(run.end[_a("1BW", i)], run.end[_a("2BW", i)])
    # Warm-up is depth-to-sink - 1 forwards: 2 on the root, 1 on each branch, 0 on the head.
    assert [str(a) for a in s.actions[0][:3]] == ["0F0", "0F1", "0F2"]
    assert [str(a) for a in s.actions[1][:3]] == ["1F0", "1F1", "1BW0"]
    assert [str(a) for a in s.actions[3][:2]] == ["3F0", "3BW0"]
    # Same bubble as a 3-stage chain: the branches run side by side.
    assert run.makespan == pytest.approx(3 * (6 + 3 - 1))
    assert s.stage_names == ("in", "a", "b", "out")


def _a(prefix: str, i: int):
    from zbjax.schedules import Action

    return Action.parse(f"{prefix}{i}")


@pytest.mark.parametrize("branches", [2, 4])
def test_fan_in_into_a_head_validates_and_zb_is_faster(branches):
    edges = _fan_in(branches, depth=2)
    placement = tuple(range(2 * branches + 1))
    for m in (1, 3, 8):
        one = dag_1f1b(edges, placement, m)
        zb = dag_zb(edges, placement, m)
        assert max(peak_memory(zb)) <= max(peak_memory(one))
        assert _measures(zb) <= _measures(one) and _measures(zb)[1] <= _measures(one)[1]
        if m >= 2 * 3:  # depth 3
            assert _measures(zb)[0] < _measures(one)[0]
    assert simulate(one, UNIT).makespan == pytest.approx(3 * (8 + 3 - 1))


def test_chain_dag_reduces_to_1f1b_bubble():
    for p, m in ((2, 4), (4, 8), (5, 3)):
        chain = tuple((s, s + 1) for s in range(p - 1))
        dag = simulate(dag_1f1b(chain, tuple(range(p)), m), UNIT)
        ref = simulate(build("1f1b", p, m), UNIT)
        assert dag.bubble_rate == pytest.approx(ref.bubble_rate)
        assert dag.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
        assert dag.peak_memory == ref.peak_memory


def test_several_stages_per_device_are_deadlock_free():
    # A diamond whose two branches share device 1, and a chain folded onto two devices.
    for edges, placement in ((DIAMOND, (0, 1, 1, 2)), (((0, 1), (1, 2), (2, 3)), (0, 1, 0, 1))):
        for m in (1, 2, 5):
            one = validate(dag_1f1b(edges, placement, m))
            zb = validate(dag_zb(edges, placement, m))
            assert one.num_devices == zb.num_devices == max(placement) + 1
            assert _measures(zb)[0] <= _measures(one)[0]


@settings(max_examples=25, deadline=None)
@given(
    st.integers(2, 6),
    st.integers(1, 10),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=8),
    st.floats(0.5, 2.0),
    st.floats(0.2, 1.5),
)
def test_random_dags_zb_never_slower_than_1f1b(num_stages, m, pairs, b_cost, w_cost):
    edges = tuple(sorted({(a, b) for a, b in pairs if a < b < num_stages}))
    placement = tuple(range(num_stages))
    costs = Costs(1.0, b_cost, w_cost, 0.0)
    one = dag_1f1b(edges, placement, m)
    zb = dag_zb(edges, placement, m, costs=costs, search_time=0.0)
    one_makespan, one_span = _measures(one, costs)
    zb_makespan, zb_span = _measures(zb, costs)
    assert zb_makespan <= one_makespan + 1e-9 and zb_span <= one_span + 1e-9
    assert max(peak_memory(zb)) <= max(peak_memory(one)) + 1e-9
    depth = max(depth_to_sink(num_stages, edges))
    if depth >= 2 and m >= 2 * depth:  # without an edge 1F1B has no bubble to fill
        assert zb_makespan < one_makespan - 1e-9


def test_dag_zb_strictly_faster_when_m_at_least_twice_the_depth():
    for edges, placement in (
        (DIAMOND, (0, 1, 2, 3)),
        (_fan_in(4), tuple(range(5))),
        (((0, 1), (1, 2), (2, 4), (3, 4)), tuple(range(5))),
    ):
        depth = max(depth_to_sink(len(placement), edges))
        for m in (2 * depth, 3 * depth):
            assert (
                _measures(dag_zb(edges, placement, m))[0]
                < _measures(dag_1f1b(edges, placement, m))[0]
            )


def test_dag_zb_respects_a_memory_limit():
    for limit in (1.0, 1.5, 2.0, 3.0):
        s = validate(dag_zb(DIAMOND, (0, 1, 2, 3), 8, mem_limit=limit))
        assert max(peak_memory(s)) <= limit and s.mem_limit == limit
    # With the default limit (dag-1f1b's peak) memory is no worse than dag-1f1b on any device.
    zb, one = dag_zb(DIAMOND, (0, 1, 2, 3), 8), dag_1f1b(DIAMOND, (0, 1, 2, 3), 8)
    assert max(peak_memory(zb)) <= max(peak_memory(one))


def test_dag_zb_uses_the_given_costs():
    costs = Costs(f=(1.0, 3.0, 1.0, 1.0), b=(1.0, 3.0, 1.0, 1.0), w=(0.5, 2.0, 0.5, 0.5))
    zb, one = dag_zb(DIAMOND, (0, 1, 2, 3), 8, costs=costs), dag_1f1b(DIAMOND, (0, 1, 2, 3), 8)
    assert _measures(zb, costs)[0] < _measures(one, costs)[0]


def test_dag_zb_runs_fused_backwards_when_the_costs_say_the_split_does_not_pay():
    # Measured costs carry the fused backward's time (pipe.measure_costs); below B + W every
    # split candidate was slower than dag-1f1b's bound, and dag-zb raised about a mem_limit
    # nobody gave.
    for bw in (1.2, 1.5, 1.9):
        costs = Costs(f=1.0, b=1.0, w=1.0, bw=bw)
        for m in (4, 8):
            zb = dag_zb(DIAMOND, (0, 1, 2, 3), m, costs=costs)
            one = dag_1f1b(DIAMOND, (0, 1, 2, 3), m)
            assert _measures(zb, costs) <= _measures(one, costs)
            assert max(peak_memory(zb)) <= max(peak_memory(one))
    # Where B + W costs what BW does, the split still wins (the fused order loses ties).
    zb = dag_zb(DIAMOND, (0, 1, 2, 3), 8, costs=Costs(f=1.0, b=1.0, w=1.0, bw=2.0))
    assert all(a.kind != "BW" for program in zb.actions for a in program)


def test_dag_zb_within_a_tight_limit_when_a_device_holds_two_stages_of_a_path():
    # Device 0 holds stages 0 and 3: one microbatch at a time needs 2 M_B there; the list
    # scheduler found no order under dag-1f1b's peak (4) and every limit below it raised.
    placement = (0, 1, 1, 0)
    for limit in (2.0, 3.0, 3.5):
        zb = validate(dag_zb(DIAMOND, placement, 4, mem_limit=limit))
        assert max(peak_memory(zb)) <= limit
    with pytest.raises(ScheduleError, match=r"needs 2 M_B on device 0 \(stages \[0, 3\].*least 2"):
        dag_zb(DIAMOND, placement, 4, mem_limit=1.5)


def test_build_registers_dag_schedules():
    one = build("dag-1f1b", 4, 8, edges=DIAMOND, placement=(0, 1, 2, 3))
    zb = build("dag-zb", 4, 8, edges=DIAMOND, placement=(0, 1, 2, 3), costs=UNIT)
    assert one.name == "dag-1f1b" and zb.name == "dag-zb" and zb.edges == DIAMOND
    limited = build("dag-zb", 4, 8, edges=DIAMOND, placement=(0, 1, 2, 3), mem_limit=2.0)
    assert max(peak_memory(limited)) <= 2.0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"edges": DIAMOND}, "missing \\['placement'\\]"),
        ({"placement": (0, 1, 2, 3)}, "missing \\['edges'\\]"),
        ({"edges": DIAMOND, "placement": (0, 1, 2)}, "num_stages = 4 but placement has 3"),
        ({"edges": ((0, 1), (1, 0)), "placement": (0, 1, 2, 3)}, "cycle"),
        ({"edges": DIAMOND, "placement": (0, 1, 2, 3), "depth": 2}, "unknown \\['depth'\\]"),
    ],
)
def test_build_dag_errors_say_what_to_pass(options, message):
    with pytest.raises(ScheduleError, match=message):
        build("dag-1f1b", 4, 4, **options)


def test_bad_placement_and_memory_errors():
    with pytest.raises(ScheduleError, match="every device"):
        dag_1f1b(DIAMOND, (0, 1, 3, 4), 4)
    with pytest.raises(ScheduleError, match=r"placement\[1\] = 1.7 is not an integer"):
        dag_1f1b(DIAMOND, (0, 1.7, 0.2, 1), 4)  # int() made it (0, 1, 0, 1), silently
    assert dag_1f1b(DIAMOND, (0, np.int64(1), 2, 3), 4).placement == (0, 1, 2, 3)
    with pytest.raises(ScheduleError, match="below the 1 M_B"):
        dag_zb(DIAMOND, (0, 1, 2, 3), 4, mem_limit=0.5)
    with pytest.raises(ScheduleError, match="mem_limit"):
        build("dag-1f1b", 4, 8, edges=DIAMOND, placement=(0, 1, 2, 3), mem_limit=2.0)
