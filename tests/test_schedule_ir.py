"""Schedule IR: actions and their text form, schedules, costs (pure Python)."""

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import zbjax
from zbjax.errors import ScheduleError
from zbjax.schedules import (
    KINDS,
    Action,
    Costs,
    Schedule,
    build,
    chain_edges,
    parse_actions,
    simulate,
    span_bubble_rate,
    validate,
)


@given(st.sampled_from(KINDS), st.integers(0, 10_000), st.integers(0, 10_000))
def test_action_text_round_trips(kind, stage, microbatch):
    action = Action(kind, stage, microbatch)
    assert Action.parse(str(action)) == action
    assert str(action) == f"{stage}{kind}{microbatch}"


def test_action_text_examples():
    assert Action.parse("2F0") == Action("F", 2, 0)
    assert Action.parse(" 3BW5 ") == Action("BW", 3, 5)
    assert Action.parse("10W12") == Action("W", 10, 12)
    assert repr(Action("B", 1, 3)) == "Action('1B3')"


@pytest.mark.parametrize("text", ["F0", "2X1", "2F", "-1F0", "2 F 0", ""])
def test_unparseable_action_text_says_how_to_write_it(text):
    with pytest.raises(ScheduleError, match="e.g. '2F0'"):
        Action.parse(text)


def test_action_rejects_unknown_kind_and_negative_indices():
    with pytest.raises(ScheduleError, match="'X' is not one of"):
        Action("X", 0, 0)
    with pytest.raises(ScheduleError, match="must be >= 0"):
        Action("F", -1, 0)
    with pytest.raises(ScheduleError, match="must be >= 0"):
        Action("B", 0, -2)
    with pytest.raises(ScheduleError, match="action F's stage = 1.5 is not an integer"):
        Action("F", 1.5, 0)  # printed as 1.5F0 before
    with pytest.raises(ScheduleError, match="action W's microbatch = True is not an integer"):
        Action("W", 0, True)
    assert Action("F", np.int64(2), np.int32(1)) == Action("F", 2, 1)
    assert type(Action("F", np.int64(2), 1).stage) is int


def test_actions_sort_and_hash_as_values():
    assert len({Action("F", 0, 1), Action.parse("0F1")}) == 1
    assert sorted([Action("W", 0, 0), Action("B", 0, 0)]) == [Action("B", 0, 0), Action("W", 0, 0)]


def _diamond() -> Schedule:
    return Schedule(
        "diamond",
        4,
        1,
        (0, 1, 2, 0),
        parse_actions("d0: 0F0 3F0 3B0 0B0 3W0 0W0\nd1: 1F0 1BW0\nd2: 2F0 2BW0"),
        edges=((0, 1), (0, 2), (1, 3), (2, 3)),
    )


def test_schedule_defaults_to_a_chain_and_counts_devices_by_action_lists():
    s = Schedule("c", 3, 2, (0, 1, 2), [[], [], []])
    assert s.edges == chain_edges(3) == ((0, 1), (1, 2))
    assert s.num_devices == 3
    assert s.mem_limit is None and s.w_mem == 0.5


def test_schedule_graph_queries_follow_the_edges():
    s = _diamond()
    assert s.predecessors(3) == (1, 2)
    assert s.successors(0) == (1, 2)
    assert s.predecessors(0) == ()
    assert s.stages_on(0) == (0, 3)
    assert len(list(s.all_actions())) == 10


def test_placement_must_have_one_device_per_stage():
    with pytest.raises(ScheduleError, match="placement has 2 entries but num_stages is 3"):
        Schedule("bad", 3, 1, (0, 1), [[], []])


def test_schedule_counts_indices_and_memory_options_are_checked():
    """int() truncated a fractional device or edge end (0.7 -> device 0), silently."""
    cases = (
        (dict(placement=(0.7, 1.9)), r"placement\[0\] = 0\.7 is not an integer"),
        (dict(edges=[(0.2, 1.6)]), r"the source of edge \(0\.2, 1\.6\) = 0\.2 is not an"),
        (dict(num_stages="2"), "Schedule num_stages = '2'; it must be an integer >= 1"),
        (dict(num_microbatches=2.0), "Schedule num_microbatches = 2.0; it must be an integer"),
        (dict(w_mem=5.0), r"Schedule w_mem = 5\.0 is out of range; it must be in \[0, 1\]"),
        (dict(mem_limit=-1), "Schedule mem_limit = -1 is out of range"),
        (dict(mem_limit="big"), "Schedule mem_limit = 'big' is not a number"),
    )
    for kwargs, message in cases:
        with pytest.raises(ScheduleError, match=message):
            Schedule(
                **(
                    dict(
                        name="s",
                        num_stages=2,
                        num_microbatches=1,
                        placement=(0, 1),
                        actions=[[], []],
                    )
                    | kwargs
                )
            )
    numpy = Schedule("s", np.int64(2), np.int32(1), (np.int64(0), 1), [[], []])
    assert (numpy.num_stages, numpy.num_microbatches, numpy.placement) == (2, 1, (0, 1))
    assert type(numpy.num_stages) is int


def test_text_form_is_one_line_per_device_and_parses_back():
    s = _diamond()
    text = s.to_text()
    assert text.splitlines()[1] == "d1: 1F0 1BW0"
    assert parse_actions(text) == s.actions
    assert parse_actions("\n  0F0 0B0\n\n1F0\n") == (
        (Action("F", 0, 0), Action("B", 0, 0)),
        (Action("F", 1, 0),),
    )
    # Labels name the device (lines in any order); the "d2" of two lines was read as device 1.
    assert parse_actions("d1: 0F0\nd0: 1F0") == ((Action("F", 1, 0),), (Action("F", 0, 0),))
    for text, problem in (
        ("d0: 0F0\nd2: 1F0", r"\['d0', 'd2'\] do not name devices d0..d1"),
        ("d0: 0F0\n1F0", r"\['d0', '\?'\] do not name"),
        ("x: 0F0", "starts with 'x:', not a device label"),
        ("d\u00b2: 0F0", "not a device label"),  # a superscript 2 is a digit to str.isdigit
    ):
        with pytest.raises(ScheduleError, match=problem):
            parse_actions(text)


def test_with_actions_keeps_everything_but_the_actions():
    s = Schedule("c", 2, 1, (0, 1), [[], []], mem_limit=3.0, w_mem=0.25, stage_names=("a", "b"))
    t = s.with_actions(parse_actions("d0: 0F0 0BW0\nd1: 1F0 1BW0"))
    assert (t.name, t.placement, t.edges, t.mem_limit, t.w_mem, t.stage_names) == (
        "c",
        (0, 1),
        ((0, 1),),
        3.0,
        0.25,
        ("a", "b"),
    )
    assert t.actions[1] == (Action("F", 1, 0), Action("BW", 1, 0))


def test_costs_expand_scalars_and_lists_per_stage():
    c = Costs(f=1.0, b=[2.0, 3.0], w=0.5, comm=0.1)
    assert c.b == (2.0, 3.0)
    assert c.per_stage(2) == ((1.0, 1.0), (2.0, 3.0), (0.5, 0.5))
    assert c.of(Action("BW", 1, 0), 2) == 3.5
    assert c.of(Action("F", 0, 0), 2) == 1.0


def test_fused_backward_costs_b_plus_w_unless_measured():
    c = Costs(f=1.0, b=[2.0, 3.0], w=0.5)
    assert c.fused_per_stage(2) == (2.5, 3.5)
    measured = Costs(f=1.0, b=[2.0, 3.0], w=0.5, bw=[2.25, 3.0])
    assert measured.bw == (2.25, 3.0)
    assert measured.of(Action("BW", 0, 0), 2) == 2.25
    assert measured.of(Action("B", 0, 0), 2) == 2.0  # B and W keep their own costs
    assert Costs(bw=1.5).fused_per_stage(3) == (1.5, 1.5, 1.5)
    with pytest.raises(ScheduleError, match="costs.bw has 1 entries but there are 2 stages"):
        Costs(bw=[1.0]).of(Action("BW", 0, 0), 2)
    with pytest.raises(ScheduleError, match="costs.bw = -1.0 is negative"):
        Costs(bw=-1.0).fused_per_stage(1)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-auto"])
def test_build_checks_the_fused_backwards_cost_too(name):
    """build and zb-auto checked f, b and w but took a NaN, negative or wrongly sized bw,
    which only simulate refused (helper HD); backward_kinds took a name (an AttributeError)."""
    for bw, message in (
        (math.nan, "costs.bw = nan"),
        (-1.0, "costs.bw = -1.0 is negative"),
        ((1, 1, -5, 1), "costs.bw = -5"),
        ((1, 1), "costs.bw has 2 entries but there are 4 stages"),
    ):
        with pytest.raises(ScheduleError, match=re.escape(message)):
            build(name, 4, 4, costs=Costs(bw=bw))
    with pytest.raises(ScheduleError, match="backward_kinds takes a Schedule, not str"):
        zbjax.schedules.backward_kinds("zb-h1")


def test_costs_reject_wrong_lengths_negative_and_nan():
    with pytest.raises(ScheduleError, match="costs.f has 3 entries but there are 2 stages"):
        Costs(f=[1, 1, 1]).per_stage(2)
    with pytest.raises(ScheduleError, match="costs.w = -1.0 is negative"):
        Costs(w=-1.0).per_stage(1)
    with pytest.raises(ScheduleError, match="NaN"):
        Costs(b=[1.0, math.nan]).per_stage(2)
    with pytest.raises(ScheduleError, match="costs.comm = -0.5"):
        Costs(comm=-0.5)
    with pytest.raises(ScheduleError, match="costs.comm_message = nan"):
        Costs(comm_message=math.nan)
    # Infinite costs simulate to nothing useful; NumPy numbers are numbers.
    with pytest.raises(ScheduleError, match="costs.f = inf is negative, infinite"):
        Costs(f=math.inf).per_stage(1)
    with pytest.raises(ScheduleError, match="costs.comm = inf"):
        Costs(comm=math.inf)
    with pytest.raises(ScheduleError, match="costs.f = 'x' is not a number"):
        Costs(f="x")
    # float() takes "2" and True; neither is a cost.
    for bad in ("2", True, ("1", 2), 1 + 2j):
        with pytest.raises(ScheduleError, match=re.escape(f"costs.f = {bad!r} is not a number")):
            Costs(f=bad)
    numpy_costs = Costs(f=np.float32(0.5), b=np.int64(2), w=np.array([1, 2]), comm=np.float64(1))
    assert numpy_costs == Costs(f=0.5, b=2.0, w=(1.0, 2.0), comm=1.0)
    assert numpy_costs.per_stage(2) == ((0.5, 0.5), (2.0, 2.0), (1.0, 2.0))


def test_an_exchange_costs_comm_plus_comm_message_per_further_message():
    costs = Costs(comm=2.0, comm_message=0.5)
    assert [costs.exchange(n) for n in (1, 2, 4)] == [2.0, 2.5, 3.5]
    assert Costs(comm=2.0).exchange(3) == 2.0  # latency-bound by default


def test_actions_may_be_written_as_text():
    written = Schedule("x", 1, 1, (0,), (("0F0", "0BW0"),))
    assert written.actions == ((Action("F", 0, 0), Action("BW", 0, 0)),)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: Schedule("x", 1, 1, (0,), ((("F", 0, 0),),)), "not an Action"),
        (lambda: Schedule("x", 1, 1, (0,), "0F0 0BW0"), "per-device action lists"),
        (lambda: Schedule("x", 1, 1, (0,), (5,)), r"actions\[0\] = 5"),
        (lambda: Schedule("x", 2, 1, None, ((), ())), "placement = None"),
        (lambda: Schedule("x", 2, 1, (0, 1), ((), ()), edges=[(0,)]), r"edge \(0,\)"),
        (lambda: Schedule("x", 2, 1, (0, 1), ((), ()), edges="0-1"), "edges = '0-1'"),
        (lambda: Schedule("x", 2, 1, (0, 1), ((), ()), stage_names=("a",)), "2 strings"),
        (lambda: Schedule("x", 2, 1, (0, 1), ((), ()), stage_names="ab"), "2 strings"),
        (lambda: Costs(comm=None), "costs.comm = None"),
        (lambda: Action.parse(5), "cannot parse action 5"),
    ],
)
def test_malformed_schedules_and_costs_raise_schedule_errors(make, needle):
    with pytest.raises(ScheduleError, match=needle):
        make()


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: build("zb-auto", 3, 2, edges="0-1"), "edges = '0-1'"),
        (lambda: build("dag-zb", 2, 2, edges=[0, 1], placement=(0, 1)), "edge 0 is not"),
        (lambda: build("dag-zb", 2, 2, edges=None, placement=(0, 1)), "edges = None"),
        (lambda: build("dag-zb", 2, 2, edges=[(0, 1)], placement=None), "placement = None"),
        (
            lambda: build("dag-zb", 2, 2, edges=[(0, 1)], placement=(0, 1), stage_names="ab"),
            "one string",
        ),
        (lambda: build("zb-v", 4, 4, mem_limit=1.5), "needs at least 2"),
        (lambda: validate("zb-h1"), "build it first"),
        (lambda: span_bubble_rate(build("1f1b", 3, 3), simulate(build("1f1b", 2, 2))), "0F2"),
        (lambda: zbjax.schedules.parse_actions(3), "text of Schedule.to_text"),
        (lambda: zbjax.schedules.dependencies(build("1f1b", 2, 2), "3F0"), "3F0 is outside"),
        (lambda: zbjax.schedules.dependencies(build("1f1b", 2, 2), 7), "takes an Action"),
        (lambda: zbjax.schedules.memory_delta(Action("B", 0, 0), 2), "w_mem = 2"),
        (lambda: zbjax.schedules.chain_edges(-1), "num_stages = -1"),
        (lambda: zbjax.schedules.dag_zb([(0, 1)], (0, 1), 2, search_time=-1), "search_time"),
    ],
)
def test_bad_arguments_to_build_and_validate_raise_schedule_errors(call, needle):
    with pytest.raises(ScheduleError, match=needle):
        call()


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "zb-h2", "interleaved-1f1b", "dag-zb"])
def test_forwards_runs_every_forward_and_keeps_devices_busy(name):
    """Schedule.forwards (what pipe.value runs): every F on its device, same placement and
    edges, no memory limit; under unit costs a chain of one stage per device takes m + p - 1,
    and no schedule takes more than its busiest device's forwards plus the longest path's;
    zb-v's forwards in its training order took 28 for 18 (4 stages, 2 devices, m 8);
    validate refuses it as a training schedule."""
    m = 8
    if name == "dag-zb":
        edges = ((0, 1), (0, 2), (1, 3), (2, 3))
        schedule = build(name, 4, m, edges=edges, placement=(0, 1, 2, 3))
    elif name == "zb-h2":
        schedule = build(name, 4, m, mem_limit=8.0)
    else:
        schedule = build(name, 4, m)  # (zb-v and interleaved-1f1b: on 2 devices)
    forwards = schedule.forwards()
    for program, kept in zip(schedule.actions, forwards.actions, strict=True):
        assert sorted(kept) == sorted(a for a in program if a.kind == "F")
    assert forwards.placement == schedule.placement and forwards.edges == schedule.edges
    assert forwards.mem_limit is None
    makespan = simulate(forwards, Costs(1, 1, 1)).makespan
    busiest = max(len(program) for program in forwards.actions)
    depth = 3 if name == "dag-zb" else schedule.num_stages
    assert makespan <= busiest + depth - 1
    if schedule.num_devices == schedule.num_stages and name != "dag-zb":
        assert makespan == m + 4 - 1
    if name == "zb-v":
        assert makespan == 18
    with pytest.raises(ScheduleError, match="completeness rule"):
        validate(forwards)
