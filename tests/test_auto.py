"""zb-auto matches or beats zb-h1/zb-h2 and the paper's automatic scheduler (pure Python)."""

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbjax.errors import ScheduleError
from zbjax.schedules import Action, Costs, Schedule, build, simulate, validate
from zbjax.schedules.auto import _bound, _Problem, zb_auto

UNIT = Costs(f=1.0, b=1.0, w=1.0, comm=0.0)
# The Zero Bubble paper's profiled (T_F, T_B, T_W, T_comm) of its 1.5B model on 8 stages.
GPT_1P5B = Costs(f=18522.0, b=18086.0, w=9337.0, comm=601.0)
# Long enough for the search to stop on its own (at the lower bound or when nothing improves,
# about 1 s here) even on a loaded machine, so the quality checks do not depend on the load.
CONVERGE = 30.0


def _span_bubble(schedule, costs):
    """Returns the paper's bubble rate: idle share of the longest first-start-to-last-end span."""
    r = simulate(schedule, costs)
    span = max(
        max(r.end[a] for a in program) - min(r.start[a] for a in program)
        for program in schedule.actions
    )
    return 1.0 - sum(r.busy) / (schedule.num_devices * span)


def _problem(p, m, costs, mem_limit):
    """Returns zb-auto's internal view of a chain of p stages."""
    f, b, w = costs.per_stage(p)
    preds = tuple((s - 1,) if s else () for s in range(p))
    succs = tuple((s + 1,) if s < p - 1 else () for s in range(p))
    edges = tuple((s, s + 1) for s in range(p - 1))
    return _Problem(p, m, f, b, w, costs.comm, mem_limit, 0.5, edges, preds, succs)


def _check(schedule, costs):
    """Returns the simulation after checking the schedule is valid and within its limit."""
    validate(schedule)
    r = simulate(schedule, costs)
    assert max(r.peak_memory) <= schedule.mem_limit + 1e-9
    return r


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_auto_at_limit_p_is_no_worse_than_zb_h1_at_equal_costs(p):
    for m in (p, 2 * p, 3 * p):
        auto = _check(zb_auto(p, m, costs=UNIT, mem_limit=p), UNIT)
        h1 = simulate(build("zb-h1", p, m), UNIT)
        assert auto.bubble_rate <= h1.bubble_rate + 1e-9
        assert auto.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_auto_at_limit_2p_has_no_bubble_inside_device_spans_when_m_ge_2p(p):
    for m in (2 * p, 3 * p):
        schedule = zb_auto(p, m, costs=UNIT, mem_limit=2 * p, time_limit=CONVERGE)
        r = _check(schedule, UNIT)
        assert _span_bubble(schedule, UNIT) == pytest.approx(0.0, abs=1e-9)
        # Only the F chain's start offset is left, which no schedule can avoid.
        assert r.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1))


def test_zb_auto_matches_the_papers_heuristic_on_the_1p5b_profile():
    # The paper reports its heuristic's bubble rates to 4 digits: 0.1585 at limit p and
    # 0.0433 at limit 2p, measured over the longest device span.
    p, m = 8, 24
    at_p = zb_auto(p, m, costs=GPT_1P5B, mem_limit=p, time_limit=CONVERGE)
    _check(at_p, GPT_1P5B)
    assert round(_span_bubble(at_p, GPT_1P5B), 4) <= 0.1585
    assert round(simulate(at_p, GPT_1P5B).bubble_rate, 4) <= 0.1585
    # That is optimal at limit p: device 0 idles until B0 is back (a round trip), as only p F
    # fit before it; after its last F it has p - 1 B and W to run until the last B is back.
    f, b, w, comm = GPT_1P5B.f, GPT_1P5B.b, GPT_1P5B.w, GPT_1P5B.comm
    trip = p * f + (p - 1) * b + 2 * (p - 1) * comm
    device_0_end = m * (f + b + w) + (trip - p * f) + (trip - f - (p - 1) * (b + w))
    assert simulate(at_p, GPT_1P5B).makespan == pytest.approx(device_0_end)
    at_2p = zb_auto(p, m, costs=GPT_1P5B, mem_limit=2 * p, objective="span", time_limit=CONVERGE)
    _check(at_2p, GPT_1P5B)
    assert round(_span_bubble(at_2p, GPT_1P5B), 4) <= 0.0433
    # Also optimal: device 0 cannot end before the last B leaves device p-1 (after its m F
    # and m B, which start (p-1)(F+comm) late), comes back over p-1 stages, and one W follows.
    bound = (p - 1) * (f + comm) + m * (f + b) + (p - 1) * (b + comm) + w
    assert _span_bubble(at_2p, GPT_1P5B) == pytest.approx(1 - m * (f + b + w) / bound)


def test_zb_auto_is_no_worse_than_zb_h2_with_unequal_costs():
    costs = Costs(f=29802.0, b=29428.0, w=19530.0, comm=577.0)
    for objective in ("makespan", "span"):
        auto = zb_auto(8, 24, costs=costs, mem_limit=16, objective=objective, time_limit=CONVERGE)
        h2 = build("zb-h2", 8, 24, mem_limit=16)
        if objective == "makespan":
            assert _check(auto, costs).makespan <= simulate(h2, costs).makespan + 1e-6
        else:
            assert _span_bubble(auto, costs) <= _span_bubble(h2, costs) + 1e-9


def test_zb_auto_runs_in_under_5_seconds_for_16_stages_and_64_microbatches():
    costs = Costs(f=11347.0, b=11248.0, w=8132.0, comm=377.0)
    began = time.perf_counter()
    schedule = zb_auto(16, 64, costs=costs, mem_limit=32)
    assert time.perf_counter() - began < 5.0
    _check(schedule, costs)


@pytest.mark.parametrize(
    "mem_limit, w_mem, costs",
    [
        (1.0, 0.5, UNIT),
        (1.5, 0.3, UNIT),
        (2.5, 0.5, Costs(f=(1.0, 2.0, 1.0, 1.5), b=(2.0, 1.0, 2.0, 1.0), w=0.5, comm=0.2)),
        (3.0, 0.0, Costs(f=1.0, b=2.0, w=0.0, comm=0.0)),
        (6.0, 1.0, Costs(f=1.0, b=1.0, w=2.0, comm=0.5)),
        (2.0, 0.5, Costs(f=0.0, b=0.0, w=0.0, comm=0.0)),
        (8.0, 0.5, Costs(f=0.0, b=1.0, w=0.0, comm=0.5)),
        (float("inf"), 0.5, UNIT),
    ],
)
def test_every_zb_auto_schedule_is_valid_and_within_its_memory_limit(mem_limit, w_mem, costs):
    schedule = zb_auto(4, 8, costs=costs, mem_limit=mem_limit, w_mem=w_mem)
    assert schedule.name == "zb-auto" and schedule.w_mem == w_mem
    _check(schedule, costs)


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(1, 5),
    m=st.integers(1, 10),
    costs=st.tuples(*[st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])] * 4),
    mem_limit=st.sampled_from([1.0, 1.5, 2.0, 3.0, 5.0, 10.0]),
    w_mem=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
)
def test_zb_auto_is_valid_within_its_limit_and_no_worse_than_zb_h1(p, m, costs, mem_limit, w_mem):
    costs = Costs(*costs)
    schedule = zb_auto(p, m, costs=costs, mem_limit=mem_limit, w_mem=w_mem, time_limit=0.2)
    r = _check(schedule, costs)
    if mem_limit >= p:
        h1 = build("zb-h1", p, m, w_mem=w_mem, mem_limit=mem_limit)
        assert r.makespan <= simulate(h1, costs).makespan + 1e-9


def _device_orders(m, mem_limit, w_mem):
    """Returns every F/B/W order of one stage (microbatch order per kind) within the limit."""
    found = []

    def extend(order, n_f, n_b, n_w, level):
        if len(order) == 3 * m:
            found.append(order)
        if n_f < m and level + 1 <= mem_limit:
            extend(order + [("F", n_f)], n_f + 1, n_b, n_w, level + 1)
        if n_b < n_f:
            extend(order + [("B", n_b)], n_f, n_b + 1, n_w, level - (1 - w_mem))
        if n_w < n_b:
            extend(order + [("W", n_w)], n_f, n_b, n_w + 1, level - w_mem)

    extend([], 0, 0, 0, 0.0)
    return found


@pytest.mark.parametrize(
    "m, costs, mem_limit",
    [
        (4, Costs(f=3.0, b=1.0, w=2.0, comm=0.5), 1.5),
        (3, Costs(f=1.0, b=3.0, w=2.0, comm=0.5), 3.0),
    ],
)
def test_zb_auto_finds_the_optimal_makespan_of_a_2_stage_pipeline(m, costs, mem_limit):
    p = 2
    makespans = []
    for pair in itertools.product(_device_orders(m, mem_limit, 0.5), repeat=p):
        actions = [[Action(kind, d, i) for kind, i in order] for d, order in enumerate(pair)]
        try:
            makespans.append(simulate(Schedule("any", p, m, (0, 1), actions), costs).makespan)
        except ScheduleError:
            continue  # this pair of orders deadlocks
    best = min(makespans)
    auto = zb_auto(p, m, costs=costs, mem_limit=mem_limit, time_limit=CONVERGE)
    assert _check(auto, costs).makespan == pytest.approx(best)
    # The lower bound zb-auto stops at must hold for every order, not just for its own.
    problem = _problem(p, m, costs, mem_limit)
    assert _bound(problem, "makespan")[0] <= best + 1e-9


@pytest.mark.parametrize(
    "edges",
    [((0, 1), (0, 2), (1, 3), (2, 3)), ((0, 2), (1, 2), (2, 3)), ((0, 1), (0, 2), (0, 3))],
)
def test_zb_auto_schedules_a_stage_dag(edges):
    uneven = Costs(f=(1.0, 2.0, 1.0, 1.0), b=(1.0, 2.0, 1.0, 1.0), w=1.0, comm=0.1)
    free_backward = Costs(f=1.0, b=0.0, w=0.0, comm=0.0)  # zero-length actions at fan-in/out
    for costs in (uneven, free_backward):
        for mem_limit in (1.0, 4.0):
            schedule = zb_auto(4, 8, costs=costs, mem_limit=mem_limit, edges=edges, time_limit=1.0)
            assert schedule.edges == edges
            _check(schedule, costs)


def test_build_zb_auto_goes_through_the_registry_with_default_limit_2p():
    schedule = build("zb-auto", num_stages=4, num_microbatches=8)
    r = simulate(schedule, UNIT)
    assert schedule.name == "zb-auto" and max(r.peak_memory) <= 8.0
    assert r.bubble_rate == pytest.approx(3 / 27)
    limited = build("zb-auto", num_stages=4, num_microbatches=8, mem_limit=2.5, time_limit=0.5)
    assert limited.mem_limit == 2.5 and max(simulate(limited).peak_memory) <= 2.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_stages": 0}, "num_stages = 0"),
        ({"num_microbatches": 0}, "num_microbatches = 0"),
        ({"costs": Costs(f=-1.0)}, "costs.f = -1.0"),
        ({"costs": Costs(w=(1.0, 1.0, -2.0, 1.0))}, "costs.w = -2.0"),
        ({"mem_limit": 0.5}, "mem_limit = 0.5"),
        ({"num_devices": 2}, "num_devices = 2"),
        ({"w_mem": 1.5}, "w_mem = 1.5"),
        ({"edges": ((0, 1), (1, 2), (2, 0))}, "cycle"),
        ({"edges": ((0, 7),)}, "edge (0, 7)"),
        ({"objective": "latency"}, "objective = 'latency'"),
        ({"num_microbatches": 2.5}, "num_microbatches = 2.5"),
        ({"time_limit": -1.0}, "time_limit = -1.0"),
        ({"time_limit": "1"}, "time_limit = '1' is not a number"),
        ({"mem_limit": "big"}, "mem_limit = 'big' is not a number"),
        ({"num_stages": "4"}, "num_stages = '4'; it must be an integer"),
    ],
)
def test_zb_auto_rejects_bad_requests_with_a_message_naming_the_value(kwargs, message):
    request = {"num_stages": 4, "num_microbatches": 8} | kwargs
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        zb_auto(**request)


def test_default_search_is_a_count_so_a_slow_or_loaded_machine_gets_the_same_schedule(
    monkeypatch,
):
    """Without time_limit the search spends a budget of evaluations, not seconds: processes
    of one multi-host job, or a rerun on a busier machine, plan the same schedule. A clock
    that races ahead (every reading a minute later) changes nothing; with time_limit it does
    bounds the search, and a racing clock leaves it no better."""
    request = dict(costs=GPT_1P5B, mem_limit=8)
    expected = zb_auto(8, 16, **request)
    assert zb_auto(8, 16, **request) == expected
    clock = itertools.count(step=60.0)
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    assert zb_auto(8, 16, **request) == expected
    hurried = zb_auto(8, 16, **request, time_limit=1.0)
    assert simulate(hurried, GPT_1P5B).makespan >= simulate(expected, GPT_1P5B).makespan
