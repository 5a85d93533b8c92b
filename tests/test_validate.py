"""validate() names the broken rule and the action, on chains and on stage DAGs (pure Python)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbjax.errors import ScheduleError
from zbjax.schedules import (
    Action,
    Schedule,
    build,
    dependencies,
    parse_actions,
    simulate,
    validate,
)

DIAMOND = ((0, 1), (0, 2), (1, 3), (2, 3))


def _schedule(text: str, placement, edges=None, num_microbatches=2, **kwargs) -> Schedule:
    """Returns a hand-written schedule from its text form."""
    return Schedule(
        "hand",
        len(placement),
        num_microbatches,
        placement,
        parse_actions(text),
        edges=edges,
        **kwargs,
    )


def _raises(schedule: Schedule, *words: str) -> str:
    """Returns validate's error message after checking it contains every word."""
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


# ---------------------------------------------------------------- stage DAG: a diamond 0->{1,2}->3

DIAMOND_VALID = """
d0: 0F0 0F1 0B0 0W0 0B1 0W1
d1: 1F0 1F1 1B0 1W0 1B1 1W1
d2: 2F0 2F1 2B0 2W0 2B1 2W1
d3: 3F0 3B0 3F1 3B1 3W0 3W1
"""


def test_diamond_schedule_is_valid_and_simulates():
    s = _schedule(DIAMOND_VALID, (0, 1, 2, 3), DIAMOND)
    assert validate(s) is s
    r = simulate(s)
    # Both branches run at once: 3F0 starts after 0F0 and one branch F.
    assert r.start[Action.parse("3F0")] == 2.0
    assert r.start[Action.parse("0B0")] == r.end[Action.parse("1B0")]


def test_fan_in_stage_waits_for_forward_of_every_predecessor():
    # Stage 3 shares device 1 with stage 1; 3F0 must follow 1F0 even though 1 != 3 - 1.
    text = """
    d0: 0F0 0F1 0B0 0W0 0B1 0W1
    d1: 3F0 1F0 1F1 3B0 3F1 3B1 1B0 1B1 3W0 3W1 1W0 1W1
    d2: 2F0 2F1 2B0 2W0 2B1 2W1
    """
    _raises(_schedule(text, (0, 1, 2, 1), DIAMOND), "order rule", "3F0", "1F0")
    fixed = text.replace("d1: 3F0 1F0", "d1: 1F0 3F0")
    validate(_schedule(fixed, (0, 1, 2, 1), DIAMOND))


def test_fan_out_stage_backward_waits_for_backward_of_every_successor():
    # Stage 2 shares device 0 with stage 0; 0B0 must follow 2B0 even though 2 != 0 + 1.
    text = """
    d0: 0F0 2F0 0F1 2F1 0B0 2B0 2B1 0B1 0W0 0W1 2W0 2W1
    d1: 1F0 1F1 1B0 1W0 1B1 1W1
    d2: 3F0 3B0 3F1 3B1 3W0 3W1
    """
    _raises(_schedule(text, (0, 1, 0, 2), DIAMOND), "order rule", "0B0", "2B0")
    fixed = text.replace("0B0 2B0 2B1", "2B0 0B0 2B1")
    validate(_schedule(fixed, (0, 1, 0, 2), DIAMOND))


def test_diamond_that_waits_across_devices_in_a_circle_deadlocks():
    # Device 0 waits for 1B0 before running 0F1; device 1 wants 1F1 before 1B0.
    text = DIAMOND_VALID.replace("d0: 0F0 0F1 0B0", "d0: 0F0 0B0 0F1").replace(
        "d1: 1F0 1F1 1B0", "d1: 1F1 1F0 1B0"
    )
    message = _raises(_schedule(text, (0, 1, 2, 3), DIAMOND), "deadlock")
    assert "device 0 waits at 0B0" in message


def test_diamond_branch_with_fused_backward_is_what_the_fan_out_waits_for():
    text = DIAMOND_VALID.replace("1B0 1W0 1B1 1W1", "1BW0 1BW1")
    s = _schedule(text, (0, 1, 2, 3), DIAMOND)
    assert Action.parse("1BW0") in dependencies(s, Action.parse("0B0"))
    validate(s)


# ---------------------------------------------------------------- each rule, on a chain

CHAIN_VALID = """
d0: 0F0 0F1 0B0 0W0 0B1 0W1
d1: 1F0 1B0 1F1 1B1 1W0 1W1
"""


def test_chain_schedule_is_valid():
    validate(_schedule(CHAIN_VALID, (0, 1)))


def test_forward_of_a_stage_before_forward_of_the_previous_stage_on_one_device_fails():
    text = "d0: 1F0 0F0 0F1 1F1 1B0 0B0 1B1 0B1 0W0 0W1 1W0 1W1"
    _raises(_schedule(text, (0, 0)), "order rule", "1F0 on device 0", "0F0")


def test_backward_before_the_next_stage_backward_on_one_device_fails():
    text = "d0: 0F0 1F0 0F1 1F1 0B0 1B0 1B1 0B1 0W0 0W1 1W0 1W1"
    _raises(_schedule(text, (0, 0)), "order rule", "0B0", "1B0")


def test_weight_gradient_before_its_backward_fails():
    text = CHAIN_VALID.replace("0B0 0W0", "0W0 0B0")
    _raises(_schedule(text, (0, 1)), "order rule", "0W0", "0B0")


def test_backward_before_its_forward_fails():
    text = CHAIN_VALID.replace("1F0 1B0", "1B0 1F0")
    _raises(_schedule(text, (0, 1)), "order rule", "1B0", "1F0")


def test_missing_forward_fails_naming_it():
    text = CHAIN_VALID.replace("0F1 ", "")
    _raises(_schedule(text, (0, 1)), "completeness rule", "0F1")


def test_missing_weight_gradient_fails_naming_it():
    text = CHAIN_VALID.replace(" 1W1", "")
    _raises(_schedule(text, (0, 1)), "completeness rule", "1W1")


def test_duplicate_action_fails():
    text = CHAIN_VALID.replace("0W1", "0W1 0W1")
    _raises(_schedule(text, (0, 1)), "completeness rule", "0W1 appears 2 times")


def test_fused_and_split_backward_together_fail():
    text = CHAIN_VALID.replace("0W1", "0W1 0BW1")
    _raises(_schedule(text, (0, 1)), "completeness rule", "0BW1", "0B1")


def test_action_on_the_wrong_device_fails():
    text = "d0: 0F0 0F1 0B0 0W0 0B1 0W1 1F0\nd1: 1B0 1F1 1B1 1W0 1W1"
    _raises(_schedule(text, (0, 1)), "device rule", "1F0 is on device 0")


def test_unknown_microbatch_and_stage_fail():
    _raises(
        _schedule(CHAIN_VALID.replace("0W1\n", "0W1 0F7\n", 1), (0, 1)),
        "device rule",
        "microbatch 7",
    )
    _raises(_schedule(CHAIN_VALID.replace("d1:", "d1: 5F0"), (0, 1)), "device rule", "stage 5")


def test_placement_on_a_device_without_an_action_list_fails():
    _raises(_schedule(CHAIN_VALID, (0, 2)), "placement rule", "device 2")


def test_cyclic_stage_graph_fails():
    _raises(_schedule(CHAIN_VALID, (0, 1), edges=((0, 1), (1, 0))), "stage graph rule", "cycle")


def test_memory_limit_is_checked_naming_the_action_that_passes_it():
    s = _schedule(CHAIN_VALID, (0, 1), mem_limit=1.5)
    _raises(s, "memory rule", "0F1 on device 0", "2 M_B", "mem_limit = 1.5")
    validate(_schedule(CHAIN_VALID, (0, 1), mem_limit=2.0))


def test_memory_rule_uses_the_schedule_w_mem():
    # 0F0 0F1 0B0: 2 - (1 - w_mem); with w_mem = 1 nothing is freed until W.
    text = "d0: 0F0 0B0 0F1 0W0 0B1 0W1\nd1: 1F0 1B0 1F1 1B1 1W0 1W1"
    validate(_schedule(text, (0, 1), mem_limit=1.5, w_mem=0.5))
    _raises(_schedule(text, (0, 1), mem_limit=1.5, w_mem=1.0), "memory rule", "0F1")


def test_deadlock_raises_and_never_hangs_on_a_long_pipeline():
    s = build("1f1b", 8, 64)
    programs = [list(p) for p in s.actions]
    d0 = programs[0]
    first_backward = next(k for k, a in enumerate(d0) if a.kind == "BW")
    # Device 0 wants 0BW0 right after 0F0: 0BW0 needs 1BW0, which needs 1F1 after the
    # warm-up of device 1, which needs 0F1, which device 0 now runs after 0BW0.
    d0.insert(1, d0.pop(first_backward))
    message = _raises(s.with_actions(programs), "deadlock")
    assert "device 0 waits at 0BW0" in message


# ---------------------------------------------------------------- properties over random schedules


@st.composite
def random_schedules(draw) -> Schedule:
    """Returns a valid schedule: random DAG or chain, placement, BW/B+W and topological order."""
    num_stages = draw(st.integers(1, 5))
    num_devices = draw(st.integers(1, num_stages))
    num_microbatches = draw(st.integers(1, 4))
    rng = draw(st.randoms(use_true_random=False))
    placement = [s % num_devices for s in range(num_stages)]
    rng.shuffle(placement)
    if draw(st.booleans()):
        edges = tuple((a, a + 1) for a in range(num_stages - 1))
    else:
        # Any edge a -> b with a < b keeps the graph acyclic.
        edges = tuple(
            (a, b)
            for a in range(num_stages)
            for b in range(a + 1, num_stages)
            if rng.random() < 0.5
        )
    fused = {(s, i): rng.random() < 0.3 for s in range(num_stages) for i in range(num_microbatches)}
    todo = []
    for (s, i), is_fused in fused.items():
        todo += [Action("F", s, i)]
        todo += [Action("BW", s, i)] if is_fused else [Action("B", s, i), Action("W", s, i)]
    template = Schedule("random", num_stages, num_microbatches, placement, [[]], edges=edges)
    kinds = {key: "BW" if f else "B" for key, f in fused.items()}
    # A random topological order of all actions, split by device, runs without deadlock.
    done: set[Action] = set()
    programs: list[list[Action]] = [[] for _ in range(num_devices)]
    while todo:
        ready = [a for a in todo if all(d in done for d in dependencies(template, a, kinds))]
        action = rng.choice(ready)
        todo.remove(action)
        done.add(action)
        programs[placement[action.stage]].append(action)
    return template.with_actions(programs)


@st.composite
def built_schedules(draw) -> Schedule:
    """Returns a generated schedule of a random name and size."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"]))
    devices = draw(st.integers(1, 6))
    per_device = draw(st.integers(1, 3)) if name == "interleaved-1f1b" else 2
    stages = devices * per_device if name in ("interleaved-1f1b", "zb-v") else devices
    return build(name, stages, draw(st.integers(1, 12)), num_devices=devices)


@settings(max_examples=150, deadline=None)
@given(st.one_of(random_schedules(), built_schedules()))
def test_random_valid_schedules_survive_the_text_round_trip(schedule):
    validate(schedule)
    assert parse_actions(schedule.to_text()) == schedule.actions
    assert validate(schedule.with_actions(parse_actions(schedule.to_text()))) is not None


@settings(max_examples=150, deadline=None)
@given(st.one_of(random_schedules(), built_schedules()), st.randoms(use_true_random=False))
def test_an_action_moved_before_its_dependency_fails_naming_that_action(schedule, rng):
    local = [
        (device, position, action, dep)
        for device, position, action in schedule.all_actions()
        for dep in dependencies(schedule, action)
        if schedule.placement[dep.stage] == device
    ]
    device, position, action, dep = rng.choice(local)
    program = list(schedule.actions[device])
    program.pop(position)
    program.insert(program.index(dep), action)
    programs = list(schedule.actions)
    programs[device] = tuple(program)
    message = _raises(schedule.with_actions(programs), "order rule")
    assert f"{action} on device {device}" in message


def test_generated_schedules_with_one_action_moved_fail_naming_it():
    rng = random.Random(0)
    for name in ("1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"):
        schedule = build(name, 8, 8)
        for _ in range(20):
            device = rng.randrange(schedule.num_devices)
            program = list(schedule.actions[device])
            position = rng.randrange(len(program))
            action = program[position]
            deps = [d for d in dependencies(schedule, action) if d in program]
            if not deps:
                continue
            program.pop(position)
            program.insert(program.index(rng.choice(deps)), action)
            programs = list(schedule.actions)
            programs[device] = tuple(program)
            message = _raises(schedule.with_actions(programs), "order rule")
            assert f"{action} on device {device}" in message
