"""Schedule pictures: the terminal grid, the Gantt chart and the Chrome/Perfetto trace."""

import json
import sys

import pytest

from zbjax.errors import ScheduleError
from zbjax.schedules import Costs, Schedule, build, parse_actions, simulate
from zbjax.schedules.plot import chrome_trace, gantt, text_grid, write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def two_device_schedule() -> Schedule:
    """1F1B with B and W split on 2 devices, 2 microbatches (makespan 8 at unit costs)."""
    return Schedule(
        name="hand-1f1b",
        num_stages=2,
        num_microbatches=2,
        placement=(0, 1),
        actions=parse_actions(
            """
            d0: 0F0 0F1 0B0 0W0 0B1 0W1
            d1: 1F0 1B0 1F1 1W0 1B1 1W1
            """
        ),
    )


def two_stages_per_device() -> Schedule:
    """Stages 0..3 on devices 0,1,0,1; every backward fused (BW), GPipe order."""
    return Schedule(
        name="hand-interleaved",
        num_stages=4,
        num_microbatches=1,
        placement=(0, 1, 0, 1),
        actions=parse_actions(
            """
            d0: 0F0 2F0 2BW0 0BW0
            d1: 1F0 3F0 3BW0 1BW0
            """
        ),
    )


def branching_schedule() -> Schedule:
    """Two encoders (text, image) joined by a head: a stage DAG on 3 devices."""
    return Schedule(
        name="hand-dag",
        num_stages=3,
        num_microbatches=1,
        placement=(0, 1, 2),
        edges=((0, 2), (1, 2)),
        stage_names=("text", "image", "head"),
        actions=parse_actions(
            """
            d0: 0F0 0B0 0W0
            d1: 1F0 1B0 1W0
            d2: 2F0 2B0 2W0
            """
        ),
    )


def test_text_grid_has_one_row_per_device_and_one_cell_per_time_slot():
    lines = text_grid(two_device_schedule()).splitlines()
    assert len(lines) == 3  # time ruler + 2 devices
    assert lines[0].split() == [str(t) for t in range(8)]
    assert lines[1] == "d0 F0 F1 .  B0 W0 .  B1 W1"
    assert lines[2] == "d1 .  F0 B0 F1 W0 B1 W1 ."


def test_text_grid_shows_stage_when_a_device_holds_several_and_continues_long_actions():
    lines = text_grid(two_stages_per_device()).splitlines()
    # BW lasts 2 units: its label, then a continuation cell.
    assert lines[1] == "d0 0F0  .    2F0  .    .    .    2BW0 ---- .    .    0BW0 ----"
    assert lines[2] == "d1 .    1F0  .    3F0  3BW0 ---- .    .    1BW0 ---- .    ."


def test_text_grid_scales_unequal_costs_to_the_shortest_action():
    schedule = two_device_schedule()
    result = simulate(schedule, Costs(f=2.0, b=2.0, w=1.0))
    lines = text_grid(schedule, result).splitlines()
    # One column is one unit (the W); F and B span two columns each.
    assert lines[1].split()[:4] == ["d0", "F0", "--", "F1"]
    assert lines[2].split()[:5] == ["d1", ".", ".", "F0", "--"]
    assert len(lines[1].split()) - 1 == result.makespan


def test_text_grid_ruler_marks_never_run_together():
    # Fractions are longer than the last (whole) time: "0.250.5" read as one number.
    schedule = build("1f1b", 2, 2)
    ruler = text_grid(schedule, simulate(schedule, Costs(f=0.25, b=0.5, w=0.25))).splitlines()[1]
    marks = ruler.split()
    assert marks[:3] == ["0", "0.5", "1"]
    assert all(float(a) < float(b) for a, b in zip(marks, marks[1:], strict=False))


def test_text_grid_ruler_writes_large_whole_times_as_it_writes_the_others():
    # Estimated costs run to 1e9: "1.81e+09  2413890625  3.017e+09" read as other scales.
    schedule = build("1f1b", 2, 2)
    costs = Costs(f=6.035e8, b=6.035e8, w=6.035e8)
    marks = text_grid(schedule, simulate(schedule, costs)).splitlines()[1].split()
    assert marks[0] == "0" and all("e+09" in m or "e+08" in m for m in marks[1:])


def test_text_grid_keeps_one_column_per_unit_on_a_short_program_and_orders_neighbours():
    # 1f1b with one microbatch: each device runs two actions in a 12-unit makespan; the unit
    # grew to 2 and drew d1's F0 beside d0's F0, which it waits for (round() of 0.5 is 0).
    lines = text_grid(build("1f1b", 4, 1)).splitlines()
    assert lines[0].split() == [str(t) for t in range(12)]
    for device in range(4):
        assert lines[1 + device].split()[1 + device] == "F0"


def test_text_grid_wraps_long_schedules_into_blocks_within_width():
    text = text_grid(two_device_schedule(), width=15)
    blocks = text.split("\n\n")
    assert len(blocks) == 2  # (15 - 3) // 3 = 4 slots per block, 8 slots
    assert all(len(line) <= 15 for line in text.splitlines())
    assert blocks[1].splitlines()[1] == "d0 W0 .  B1 W1"


def test_text_grid_names_branches_of_a_stage_dag():
    lines = text_grid(branching_schedule()).splitlines()
    assert lines[1].startswith("d0 text ")
    assert lines[2].startswith("d1 image ")
    assert lines[3].split() == ["d2", "head", ".", "F0", "B0", "W0", "."]


def test_chrome_trace_has_one_complete_event_per_action_with_its_times():
    schedule = two_device_schedule()
    costs = Costs(f=2.0, b=2.0, w=1.0, comm=0.5)
    result = simulate(schedule, costs)
    trace = chrome_trace(schedule, costs)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(p) for p in schedule.actions)
    by_name = {e["name"]: e for e in complete if e["tid"] == 1}
    event = by_name["F s1 mb1"]
    assert event["pid"] == 0
    assert event["args"] == {"kind": "F", "stage": 1, "microbatch": 1, "action": "1F1"}
    action = schedule.actions[1][2]
    assert event["ts"] == result.start[action] * 1000
    assert event["dur"] == 2000
    assert trace["otherData"]["us_per_cost_unit"] == 1000  # what the times mean
    threads = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert threads == {0: "device 0", 1: "device 1"}
    # Costs in seconds (as pipe.measure_costs gives them) drawn at their real length.
    seconds = Costs(f=2e-3, b=2e-3, w=1e-3, comm=5e-4)
    timed = chrome_trace(schedule, seconds, unit_us=1e6)
    event = next(e for e in timed["traceEvents"] if e["name"] == "F s1 mb1" and e["tid"] == 1)
    assert event["ts"] == pytest.approx(result.start[action] * 1000)
    assert event["dur"] == pytest.approx(2000)
    assert timed["otherData"]["us_per_cost_unit"] == 1e6
    for bad in (0, -1.0, float("inf"), "ms", None):
        with pytest.raises(ScheduleError, match="unit_us=.*1e6 for costs in seconds"):
            chrome_trace(schedule, costs, unit_us=bad)


def test_write_trace_writes_json_that_loads_back(tmp_path):
    path = write_trace(two_device_schedule(), tmp_path / "trace.json")
    assert json.loads(path.read_text()) == chrome_trace(two_device_schedule())
    # Into a folder that does not exist yet, as pipe.profile's trace_dir: it is made.
    assert write_trace(two_device_schedule(), tmp_path / "new" / "trace.json").is_file()


def test_gantt_saves_a_png_titled_with_name_sizes_and_bubble_rate(tmp_path):
    path = tmp_path / "gantt.png"
    fig = gantt(two_device_schedule(), path=path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    title = fig.axes[0].get_title()
    assert "hand-1f1b" in title and "p=2" in title and "m=2" in title
    assert "bubble rate 25.0%" in title  # 12 units of work on 2 devices x 8
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["F forward", "B input grad", "W weight grad"]


def test_gantt_labels_boxes_with_stage_names_on_a_dag():
    fig = gantt(branching_schedule())
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert {"text:0", "image:0", "head:0"} <= labels
    hatches = {p.get_hatch() for p in fig.axes[0].patches}
    assert len(hatches) == 3  # each stage its own hatch


def test_gantt_without_matplotlib_names_the_extra_to_install(monkeypatch):
    for module in (
        "matplotlib",
        "matplotlib.backends.backend_agg",
        "matplotlib.figure",
        "matplotlib.patches",
    ):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install 'zbjax\[plot\]'"):
        gantt(two_device_schedule())


def test_text_grid_takes_costs_as_gantt_does():
    schedule = build("zb-h1", 2, 2)
    costs = Costs(f=1, b=2, w=1)
    assert text_grid(schedule, costs) == text_grid(schedule, simulate(schedule, costs))


def test_text_grid_leaves_out_actions_that_take_no_time():
    # A W of cost 0 took a column and pushed every later action of its device right, so the
    # ruler ran past the makespan and F2 was drawn one slot after it starts.
    schedule = build("zb-h1", 2, 3)
    result = simulate(schedule, Costs(f=1, b=1, w=0))
    lines = text_grid(schedule, result).splitlines()
    assert lines[0].split()[-1] == f"{result.makespan - 1:g}"  # one column per time unit
    starts = {a: result.start[a] for a in schedule.actions[0]}
    cells = lines[1].split()[1:]
    for action, start in starts.items():
        if action.kind != "W":
            assert cells[int(start)] == f"{action.kind}{action.microbatch}"
    assert "W" not in lines[1] + lines[2]
    assert lines[-1] == "(W of stages 0, 1: no time, not drawn)"
    # Only the stages whose actions take no time are named: the report said "B actions take
    # no time" when only stage 0's B did and the others' were drawn (helper HD).
    lines = text_grid(schedule, simulate(schedule, Costs(f=1, b=(0, 1), w=1))).splitlines()
    assert lines[-1] == "(B of stage 0: no time, not drawn)"
    assert "B0" in lines[2]


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda s: simulate(s, (1, 1, 1)), "is not a zbjax.schedules.Costs"),
        (lambda s: simulate("zb-h1"), "build it first"),
        (lambda s: text_grid(s, simulate(build("1f1b", 3, 3))), "not this schedule's"),
        (lambda s: text_grid(s, width=0), "width = 0"),
        (lambda s: gantt(s, path=""), "not a file name"),
        (lambda s: write_trace(s, "."), "is a directory"),
        (lambda s: chrome_trace("zb-h1"), "takes a Schedule"),
    ],
)
def test_wrong_arguments_raise_schedule_errors(call, needle):
    with pytest.raises(ScheduleError, match=needle):
        call(build("zb-h1", 2, 2))


def test_simulated_times_that_overflow_are_refused():
    with pytest.raises(ScheduleError, match="overflow"):
        simulate(build("1f1b", 2, 2), Costs(f=1e308, b=1e308, w=1e308))
