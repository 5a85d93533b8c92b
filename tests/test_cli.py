"""The ``zbjax`` command line: ``zbjax schedule NAME -p P -m M ...``."""

import json
import subprocess
import sys

import pytest

from zbjax.cli import main, parse_costs
from zbjax.schedules import Action

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_json(capsys, *argv: str) -> dict:
    """Returns the JSON object ``zbjax schedule ... --json`` prints."""
    assert main(["schedule", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def test_json_output_describes_schedule_and_simulation(capsys):
    report = run_json(capsys, "zb-h1", "-p", "4", "-m", "8")
    for key in (
        "name",
        "num_stages",
        "num_devices",
        "num_microbatches",
        "makespan",
        "bubble_rate",
        "peak_memory",
        "placement",
        "actions",
    ):
        assert key in report
    assert (report["name"], report["num_stages"], report["num_devices"]) == ("zb-h1", 4, 4)
    assert report["num_microbatches"] == 8
    assert len(report["peak_memory"]) == len(report["actions"]) == 4
    actions = [Action.parse(a) for program in report["actions"] for a in program]
    assert sorted((a.kind, a.stage, a.microbatch) for a in actions) == sorted(
        (kind, s, i) for kind in "FBW" for s in range(4) for i in range(8)
    )


def test_zb_h1_bubble_equals_p_minus_1_over_3m_plus_p_minus_1(capsys):
    report = run_json(capsys, "zb-h1", "-p", "4", "-m", "8")
    assert report["bubble_rate"] == pytest.approx(3 / 27)
    assert report["makespan"] == pytest.approx(27)


def test_stage_count_follows_from_the_schedule_and_stages_overrides_it(capsys):
    assert run_json(capsys, "zb-v", "-p", "2", "-m", "4")["num_stages"] == 4
    assert run_json(capsys, "interleaved-1f1b", "-p", "2", "-m", "4")["num_stages"] == 4
    report = run_json(capsys, "interleaved-1f1b", "-p", "2", "-m", "4", "--stages", "6")
    assert (report["num_stages"], report["num_devices"]) == (6, 2)


def test_costs_and_memory_options_reach_the_schedule(capsys):
    report = run_json(
        capsys, "1f1b", "-p", "2", "-m", "2", "--costs", "2,3,1,0.5", "--w-mem", "0.25"
    )
    assert report["costs"] == {"f": 2.0, "b": 3.0, "w": 1.0, "comm": 0.5}
    assert report["w_mem"] == 0.25
    report = run_json(capsys, "zb-auto", "-p", "2", "-m", "4", "--mem-limit", "3")
    assert max(report["peak_memory"]) <= 3


def test_text_output_prints_grid_makespan_bubble_rate_and_peak_memory(capsys):
    assert main(["schedule", "zb-h1", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("d")] == [
        "d0",
        "d1",
        "d2",
        "d3",
    ]
    assert "makespan     27" in out
    assert "bubble rate  0.1111" in out
    assert "peak memory  " in out


def test_plot_writes_a_png_and_trace_writes_one_event_per_action(tmp_path, capsys):
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    argv = ["schedule", "zb-h1", "-p", "2", "-m", "4", "--plot", str(png), "--trace", str(trace)]
    assert main(argv) == 0
    capsys.readouterr()
    assert png.read_bytes()[:8] == PNG_MAGIC
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * 2 * 4
    assert {e["tid"] for e in events} == {0, 1}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["zb-h1", "-p", "0", "-m", "8"], "-p 0"),
        (["zb-h1", "-p", "4", "-m", "-1"], "-m -1"),
        (["zb-h1", "-p", "4", "-m", "8", "--costs", "1,2"], "'1,2'"),
        (["zb-h1", "-p", "4", "-m", "8", "--costs", "1,x,1,0"], "'x'"),
        (["zb-h1", "-p", "4", "-m", "8", "--costs", "1,-2,1,0"], "-2"),
        (["zb-h9", "-p", "4", "-m", "8"], "zb-h9"),
        (["zb-auto", "-p", "4", "-m", "8", "--mem-limit", "0.5"], "0.5"),
        (["zb-v", "-p", "2", "-m", "4", "--stages", "3"], "3"),
        (["zb-h1", "-p", "4", "-m", "8", "--w-mem", "1.5"], "1.5"),
    ],
)
def test_bad_input_exits_2_naming_the_value_without_traceback(argv, named, capsys):
    assert main(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert named in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_missing_option_is_an_argparse_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["schedule", "zb-h1", "-p", "4"])
    assert exit_info.value.code == 2
    assert "-m" in capsys.readouterr().err


def test_parse_costs_reads_three_or_four_numbers():
    assert parse_costs("1,2,0.5,0.1") == (1.0, 2.0, 0.5, 0.1)
    assert parse_costs("1, 2, 3") == (1.0, 2.0, 3.0, 0.0)


def test_console_script_exits_2_with_a_message_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "zbjax.cli", "schedule", "zb-h9", "-p", "2", "-m", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "zb-h9" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dag_schedule_from_edges_shows_named_branches(capsys):
    report = run_json(
        capsys,
        "dag-zb",
        "-p",
        "4",
        "-m",
        "6",
        "--edges",
        "0-1,0-2,1-3,2-3",
        "--stage-names",
        "embed,text,image,head",
    )
    assert report["edges"] == [[0, 1], [0, 2], [1, 3], [2, 3]]
    assert report["stage_names"] == ["embed", "text", "image", "head"]
    assert report["placement"] == [0, 1, 2, 3]
    assert 0 <= report["span_bubble_rate"] <= report["bubble_rate"] + 1e-12
    assert main(["schedule", "dag-1f1b", "-p", "4", "-m", "4", "--edges", "0-1,0-2,1-3,2-3"]) == 0
    grid = capsys.readouterr().out
    assert "BW0" in grid and "span bubble" in grid


DIAMOND = ["--edges", "0-1,0-2,1-3,2-3"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["dag-zb", "-p", "4", "-m", "4"], "--edges"),
        (["dag-zb", "-p", "3", "-m", "4", "--edges", "0-1,0-2,1-3,2-3"], "--placement"),
        (["dag-zb", "-p", "4", "-m", "4", "--edges", "0>1"], "'0>1'"),
        (["zb-h1", "-p", "4", "-m", "4", "--edges", "0-1"], "zb-h1"),
        (["dag-zb", "-p", "2", "-m", "4", "--edges", "0-1", "--stage-names", "a"], "1 names"),
        # -p and --stages were ignored beside --placement / --edges.
        (["dag-zb", "-p", "4", "-m", "4", *DIAMOND, "--placement", "0,1,1,0"], "(2 devices) but"),
        (["dag-zb", "-p", "4", "-m", "4", *DIAMOND, "--stages", "7"], "7 but"),
        (["dag-zb", "-p", "2", "-m", "4", "--edges", "0-1,1-2", "--placement", "0,1"], "2 devices"),
    ],
)
def test_bad_dag_options_exit_2_naming_the_value(capsys, argv, needle):
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_plot_and_trace_paths_are_reported_as_written(tmp_path, capsys, monkeypatch):
    # matplotlib adds ".png" to a name without a suffix; the report once named the file
    # given, not the one written. A directory or an empty name is refused before any work.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outdir").mkdir()
    assert main(["schedule", "zb-h1", "-p", "2", "-m", "2", "--plot", "chart"]) == 0
    assert "wrote gantt chart to chart.png" in capsys.readouterr().out
    assert (tmp_path / "chart.png").read_bytes()[:8] == PNG_MAGIC
    for flag, path, needle in (
        ("--plot", "outdir", "is a directory"),
        ("--trace", "outdir", "is a directory"),
        ("--plot", "", "is not a file name"),
    ):
        assert main(["schedule", "zb-h1", "-p", "2", "-m", "2", flag, path]) == 2
        captured = capsys.readouterr()
        assert needle in captured.err and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png", "outdir"]
    # Errors name the flag; no folder is made before the schedule is known (helper Q1).
    (tmp_path / "afile").write_text("")
    for argv, needle in (
        (["--plot", "afile/x.png"], "--plot path 'afile/x.png': its folder 'afile' cannot be"),
        (["--plot", "out.txt"], "--plot 'out.txt': matplotlib writes no 'txt' files"),
        (["--plot", "new/out.txt"], "matplotlib writes no 'txt' files"),
        (["--trace", "traces/"], "--trace path 'traces/' is a directory"),
        (["--plot", "same", "--trace", "same.png"], "both name 'same.png'"),
        (["--trace", "afile/t.json"], "--trace path 'afile/t.json'"),
    ):
        assert main(["schedule", "zb-h1", "-p", "2", "-m", "2", *argv]) == 2
        assert needle in capsys.readouterr().err
    argv = ["--plot", "new/x.png", "--trace", "other/t.json"]
    assert main(["schedule", "zb-h9", "-p", "2", "-m", "2", *argv]) == 2
    assert "unknown schedule 'zb-h9'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "chart.png", "outdir"]


def test_sizes_past_what_the_simulation_takes_are_refused_naming_the_bound(capsys):
    """-m 10**20 grew past 22 GB before anything was refused."""
    for p, m in (("1", str(10**20)), ("1001", "1000")):
        assert main(["schedule", "gpipe", "-p", p, "-m", m]) == 2
        err = capsys.readouterr().err
        assert "more than zbjax schedule builds" in err and "1,000,000" in err


def test_schedule_errors_say_which_flags_the_arguments_they_name_are(capsys):
    assert main(["schedule", "1f1b", "-p", "4", "-m", "4", "--stages", "3"]) == 2
    assert "(num_stages is --stages, num_devices is -p)" in capsys.readouterr().err


def test_json_is_strict_json_with_no_memory_limit_as_null(capsys):
    assert main(["schedule", "zb-h1", "-p", "2", "-m", "2", "--mem-limit", "inf", "--json"]) == 0
    text = capsys.readouterr().out
    assert "Infinity" not in text
    assert json.loads(text)["mem_limit"] is None


def test_zb_auto_takes_a_stage_dag_from_edges(capsys):
    report = run_json(capsys, "zb-auto", "-p", "4", "-m", "4", *DIAMOND)
    assert report["edges"] == [[0, 1], [0, 2], [1, 3], [2, 3]]
    assert report["placement"] == [0, 1, 2, 3]
    assert main(["schedule", "zb-auto", "-p", "3", "-m", "4", *DIAMOND]) == 2
    assert "one stage per device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "costs, needle",
    [("1,1", "3 or 4"), ("1e308,1e308,1e308", "overflow"), ("1,1,1,1e308", "overflow")],
)
def test_costs_messages_say_what_is_accepted(capsys, costs, needle):
    assert main(["schedule", "zb-h1", "-p", "2", "-m", "2", "--costs", costs]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.out == ""


def test_a_reader_that_stops_early_is_not_an_error():
    # `zbjax schedule ... | head -1` printed "error: Broken pipe".
    argv = [sys.executable, "-m", "zbjax.cli", "schedule", "zb-v", "-p", "8", "-m", "64"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=120) in (0, 1)
    assert proc.stderr.read() == b""
