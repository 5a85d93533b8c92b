"""``zbjax demo`` and its corpus: a short pipelined training run matches unpipelined training."""

import dataclasses
import io
import json
import pathlib
import random
import re

import numpy as np
import pytest

from zbjax import demo
from zbjax.cli import main
from zbjax.data import ALPHABET, CharTokenizer, batch_at, synthetic_sentence, synthetic_text
from zbjax.demo import DemoConfig, Progress, StepInfo, compare_first_step, run_demo, summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

#: A short demo: tiny GPT, 4 pipeline devices, 5 steps.
TINY = DemoConfig(
    devices=4,
    microbatches=4,
    layers=4,
    width=16,
    heads=2,
    steps=5,
    batch_size=8,
    seq_len=16,
    lr=1e-2,
    corpus_chars=4096,
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Returns (DemoResult, the report passed to on_report, the steps passed to on_step)."""
    out = tmp_path_factory.mktemp("demo")
    config = dataclasses.replace(TINY, out_dir=str(out), profile_dir=str(out / "profile"))
    reports, steps = [], []
    result = run_demo(config, on_report=reports.append, on_step=steps.append)
    return result, reports, steps


# ----------------------------------------------------------------------------- corpus


def test_synthetic_text_is_deterministic_lower_case_sentences():
    text = synthetic_text(2000, seed=3)
    assert text == synthetic_text(2000, seed=3)
    assert text != synthetic_text(2000, seed=4)
    assert len(text) >= 2000
    assert set(text) <= set(ALPHABET)
    assert synthetic_sentence(random.Random(0)).endswith(".")


def test_char_tokenizer_round_trips_and_names_unknown_characters():
    tokenizer = CharTokenizer()
    text = synthetic_text(500)
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.max() < tokenizer.vocab_size
    assert tokenizer.decode(ids) == text
    with pytest.raises(ValueError, match="'Q'"):
        tokenizer.encode("a Quick fox")


def test_batch_at_gives_shifted_windows_that_depend_only_on_seed_and_step():
    tokens = np.arange(100, dtype=np.int32)
    batch = batch_at(tokens, step=2, batch_size=4, seq_len=8, seed=1)
    assert batch["tokens"].shape == batch["targets"].shape == (4, 8)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
    np.testing.assert_array_equal(batch["tokens"][:, 1:] - batch["tokens"][:, :-1], 1)
    again = batch_at(tokens, step=2, batch_size=4, seq_len=8, seed=1)
    np.testing.assert_array_equal(batch["tokens"], again["tokens"])
    other = batch_at(tokens, step=3, batch_size=4, seq_len=8, seed=1)
    assert not np.array_equal(batch["tokens"], other["tokens"])
    with pytest.raises(ValueError, match="seq_len=100"):
        batch_at(tokens, step=0, batch_size=1, seq_len=100)


# ----------------------------------------------------------------------------- the demo run


def test_short_pipelined_run_lowers_the_loss(tiny_run):
    result, _, _ = tiny_run
    assert (result.num_devices, result.num_stages) == (4, 4)
    assert len(result.losses) == len(result.step_seconds) == 5
    assert result.loss_decreased
    assert result.losses[-1] < result.losses[0] - 0.05


def test_first_step_equals_unpipelined_value_and_grad(tiny_run):
    first = tiny_run[0].first_step
    assert first.passed
    assert first.loss == pytest.approx(first.reference_loss, rel=1e-5)
    assert first.grad_max_rel_diff < 1e-4


def test_final_loss_equals_unpipelined_adamw_run_of_the_same_steps(tiny_run):
    result = tiny_run[0]
    final = result.final
    assert final is not None and final.passed
    assert final.loss == pytest.approx(final.reference_loss, rel=1e-4)
    np.testing.assert_allclose(result.losses, final.reference_losses, rtol=1e-4)
    assert result.passed


def test_held_out_loss_from_pipe_value_falls_and_equals_the_unpipelined_loss(tiny_run):
    """The demo evaluates held-out text with pipe.value (the forwards alone) before and after
    training: the loss falls, and after training it equals loss_fn unpipelined on the
    trained params; the summary says so."""
    result = tiny_run[0]
    held = result.held_out
    assert held is not None and held.passed
    assert held.after < held.before
    assert held.after == pytest.approx(held.reference, rel=1e-5)
    assert "held-out evaluation" in dict(result.phase_seconds)
    assert re.search(r"held-out loss \(pipe.value.*\.\.\. PASS", summary(result))


def test_report_progress_and_schedule_files(tiny_run):
    result, reports, steps = tiny_run
    assert len(reports) == 1
    assert "4 stages on 4 devices" in reports[0]
    assert "per-device memory" in reports[0]
    assert [s.step for s in steps] == list(range(5))
    assert 0 < steps[0].bubble_rate < 1
    # The progress line simulates the schedule with the report's costs: the same bubble rate.
    assert f"simulated bubble rate: {steps[0].bubble_rate:.3f}" in reports[0]
    png = next(p for p in result.files if p.endswith(".png"))
    trace = next(p for p in result.files if p.endswith(".json"))
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * 4 * 4  # F, B and W of 4 stages x 4 microbatches
    # Perfetto reads microseconds: the simulated step lasts the measured median step (the
    # cost estimates as microseconds x 1000 showed a 5 ms step as 42 hours).
    makespan_us = max(e["ts"] + e["dur"] for e in events)
    median_step = float(np.median(result.step_seconds[1:]))
    assert makespan_us == pytest.approx(median_step * 1e6, rel=1e-6)
    text = summary(result)
    assert text.count("PASS") == 3 and "FAIL" not in text  # first step, final, held-out
    assert f"lasts the median measured step ({median_step * 1e3:.1f} ms)" in text


def test_profile_writes_a_jax_profiler_trace_and_times_every_action_from_it(tiny_run):
    result = tiny_run[0]
    profile = next(p for p in result.files if p.endswith("profile"))
    assert list(pathlib.Path(profile).rglob("*.xplane.pb"))
    times = result.action_times
    assert times is not None and times.steps == 2
    ran = {scope for scopes in times.seconds.values() for scope, sec in scopes.items() if sec > 0}
    assert set(times.runs) <= ran, (times.runs, ran)  # every action of the schedule was seen
    assert "time per action in the 2 profiled steps" in summary(result)


def test_cli_demo_passes_flags_prints_report_progress_and_exits_1_on_fail(
    tiny_run, monkeypatch, capsys
):
    result, reports, steps = tiny_run
    seen = []

    def fake_run_demo(config, on_report, on_step):
        """Replays the tiny run, so that this test checks the CLI and not the training."""
        seen.append(config)
        on_report(reports[0])
        for info in steps:
            on_step(info)
        return outcome

    monkeypatch.setattr("zbjax.demo.run_demo", fake_run_demo)
    argv = ["demo", "--schedule", "1f1b", "--devices", "4", "--stages", "4", "--layers", "4"]
    argv += ["--width", "16", "--steps", "5", "--lr", "0.01", "--profile", "P", "--out", "O"]
    outcome = result
    assert main([*argv, "--no-check-final"]) == 0
    out = capsys.readouterr().out
    config = seen[0]
    assert (config.schedule, config.devices, config.stages, config.layers) == ("1f1b", 4, 4, 4)
    assert (config.width, config.steps, config.lr) == (16, 5, 0.01)
    assert (config.profile_dir, config.out_dir, config.check_final) == ("P", "O", False)
    assert "4 stages on 4 devices" in out
    assert sum(line.startswith("step ") for line in out.splitlines()) == 5
    assert out.rstrip().endswith("PASS")
    failed = dataclasses.replace(result.first_step, passed=False)
    outcome = dataclasses.replace(result, first_step=failed)
    assert main(argv) == 1
    assert "FAIL: the pipelined run differs" in capsys.readouterr().out
    # A diverged run is not a pipelining mismatch: both runs went to NaN.
    nan = float("nan")
    final = dataclasses.replace(result.final, passed=False, reference_losses=(3.0, nan))
    outcome = dataclasses.replace(result, losses=(*result.losses[:-1], nan), final=final)
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL: the training diverged (a non-finite loss); so did the unpipelined" in out


def test_final_check_judges_the_params_after_the_last_update():
    """The last loss is computed before the last update, so the params after it are judged
    too: against the largest change training made (FINAL_PARAM_RTOL of it)."""
    initial = {"w": np.array([1.0, 2.0])}
    reference = {"w": np.array([0.9, 2.1])}  # training moved each param by 0.1
    close = {"w": np.array([0.9 + 1e-3, 2.1])}
    far = {"w": np.array([0.9 + 5e-3, 2.1])}
    good = demo.compare_final([3.0], close, [3.0], reference, initial)
    bad = demo.compare_final([3.0], far, [3.0], reference, initial)
    assert good.passed and good.reference_param_change == pytest.approx(0.1)
    assert not bad.passed and bad.loss_rel_diff == 0
    assert bad.param_max_abs_diff == pytest.approx(5e-3)


def test_first_step_check_fails_on_a_wrong_gradient():
    ref = {"a": np.array([1.0, -2.0]), "b": np.array([0.5])}
    wrong = {"a": np.array([1.0, -2.0]), "b": np.array([0.6])}
    good = compare_first_step(1.0, ref, 1.0, ref)
    bad = compare_first_step(1.0, wrong, 1.0, ref)
    assert good.passed and good.grad_max_abs_diff == 0
    assert not bad.passed
    assert bad.worst_leaf == "['b']"
    assert bad.grad_max_rel_diff == pytest.approx(0.2)


def test_progress_prints_lines_in_a_log_and_a_carriage_return_bar_on_a_terminal():
    infos = [StepInfo(i, 3, 3.0 - i, 0.5, 2048.0, 0.25) for i in range(3)]
    log = io.StringIO()
    for info in infos:
        Progress(log, tty=False)(info)
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in log.getvalue()
    assert lines[2].startswith("step 3/3") and "loss 1.0000" in lines[2]
    assert "500 ms" in lines[2] and "2,048 tok/s" in lines[2] and "25.0%" in lines[2]
    term = io.StringIO()
    for info in infos:
        Progress(term, tty=True)(info)
    assert term.getvalue().count("\r") == 3 and term.getvalue().endswith("\n")
    assert "[" + "#" * 24 + "]" in term.getvalue()


def test_cli_demo_rejects_bad_sizes_naming_the_value(capsys, tmp_path):
    assert main(["demo", "--batch-size", "6", "--microbatches", "4", "--devices", "2"]) == 2
    assert "--batch-size 6 is not divisible by --microbatches 4" in capsys.readouterr().err
    assert main(["demo", "--schedule", "zb-v", "--devices", "2", "--layers", "1"]) == 2
    assert "layers" in capsys.readouterr().err
    # --stages other than the schedule's count: the CLI user gets the demo's terms (the
    # errors named num_stages=, placement= and partitioner=, which the demo has no flags for).
    for argv in (["--stages", "3"], ["--schedule", "interleaved-1f1b", "--stages", "6"]):
        assert main(["demo", "--devices", "2", *argv]) == 2
        err = capsys.readouterr().err
        assert "leave stages out" in err and "num_stages=" not in err
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err
    # A file where a directory goes: the profiler failed only after training, in a traceback.
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for flag in ("--profile", "--out"):
        assert main(["demo", "--devices", "2", flag, str(a_file)]) == 2
        assert "is a file, not a directory" in capsys.readouterr().err
    assert main(["demo", "--devices", "2", "--profile", str(a_file / "sub")]) == 2
    assert "cannot be made a directory" in capsys.readouterr().err
    # A seed numpy refuses, an lr that diverges at once, a tp that would split nothing.
    for argv, needle in [
        (["--seed", "-1"], "--seed -1"),
        (["--seed", str(2**63)], "below 2**63"),
        (["--lr", "inf"], "--lr inf; the learning rate must be finite"),
        (["--tp", "3"], "--tp 3 must divide --heads 4"),
        # An unknown schedule is named as such, not as too few layers for its stages.
        (["--schedule", "zb-h3", "--layers", "3"], "--schedule 'zb-h3' is not a schedule"),
        # The CLI names its flags, not DemoConfig's fields (batch_size=, out_dir=); an empty
        # directory name wrote into the current one (helper Q1).
        (["--out", ""], "--out '' is not a directory name"),
        (["--profile", ""], "--profile '' is not a directory name"),
        # ... and leaves the values it quotes as given (a run folder named runs/lr=3e-4).
        (["--schedule", "lr=1"], "--schedule 'lr=1' is not a schedule"),
    ]:
        assert main(["demo", "--devices", "2", *argv]) == 2
        assert needle in capsys.readouterr().err


def test_stage_count_errors_name_the_schedule_s_own_fix(capsys):
    """A DAG schedule given fewer stages than devices was told to use a DAG schedule; a
    two-stages-per-device schedule given too few stages was pointed at DAG schedules too."""
    for schedule in ("dag-1f1b", "dag-zb"):
        argv = ["demo", "--schedule", schedule, "--devices", "2", "--stages", "1"]
        assert main([*argv, "--layers", "4"]) == 2
        err = capsys.readouterr().err
        assert f"{schedule} runs at least one stage per device" in err
        assert "--stages 2 or more, or --devices 1" in err and "use dag-" not in err
    assert main(["demo", "--schedule", "zb-v", "--stages", "8"]) == 2
    err = capsys.readouterr().err
    assert "zb-v runs 2 stages per device, so 16 stages on 8" in err
    assert "leave stages out and use --devices 4" in err and "dag-" not in err
    assert main(["demo", "--schedule", "zb-v", "--devices", "2", "--stages", "3"]) == 2
    assert "use an even --stages" in capsys.readouterr().err
    # More stages than a one-stage-per-device schedule runs: the DAG schedules take them.
    assert main(["demo", "--schedule", "1f1b", "--devices", "2", "--stages", "3"]) == 2
    err = capsys.readouterr().err
    assert "use --devices 3; or, for more stages than that, dag-1f1b or dag-zb" in err


def test_too_few_layers_names_the_flags_that_fix_it(capsys):
    assert main(["demo", "--schedule", "zb-v", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "8 layers make 9 chain units (the blocks, then the head), too few for 16" in err
    assert "use --layers 15 or more, or --devices 4 or fewer (zb-v runs 2 stages" in err
    assert main(["demo", "--devices", "8", "--layers", "4"]) == 2
    assert "use --layers 7 or more, or --devices 5 or fewer\n" in capsys.readouterr().err
    argv = ["demo", "--schedule", "dag-zb", "--devices", "2", "--stages", "9", "--layers", "4"]
    assert main(argv) == 2
    assert "use --layers 8 or more, or --stages 5 or fewer" in capsys.readouterr().err


def test_default_devices_fit_the_layers_and_say_so():
    """zb-v and interleaved-1f1b failed with the defaults: 16 stages on all 8 devices, but 8
    layers make 9 chain units. Left to choose, the demo takes the devices the layers fit."""
    devices, note = demo._default_devices(DemoConfig(schedule="zb-v"))
    assert devices == 4
    assert note.startswith("devices: 4 of the 8 present, since zb-v runs 2 stages per device")
    assert demo._default_devices(DemoConfig(schedule="interleaved-1f1b"))[0] == 4
    assert demo._default_devices(DemoConfig()) == (None, None)  # zb-h1: 8 stages fit
    assert demo._default_devices(DemoConfig(layers=3))[0] == 4
    assert demo._default_devices(DemoConfig(schedule="zb-v", tp=2)) == (None, None)
    # What the user set stays: the errors above name the fix.
    assert demo._default_devices(DemoConfig(schedule="zb-v", devices=8)) == (8, None)
    assert demo._default_devices(DemoConfig(schedule="zb-v", stages=16)) == (None, None)
    config = dataclasses.replace(TINY, schedule="zb-v", devices=None, layers=3, steps=2)
    reports = []
    result = run_demo(dataclasses.replace(config, out_dir=None, check_final=False), reports.append)
    assert (result.num_devices, result.num_stages) == (2, 4) and result.passed
    assert reports[0].startswith("devices: 2 of the 8 present, since zb-v runs 2 stages")
    assert "4 stages on 2 devices" in reports[0]


def test_dag_schedules_place_more_stages_than_devices_in_blocks():
    config = DemoConfig(schedule="dag-zb", devices=2, stages=5)
    assert demo._stages_and_placement(config, 2) == (5, (0, 0, 0, 1, 1))
    assert demo._stages_and_placement(DemoConfig(schedule="zb-v"), 2) == (4, None)


def test_summary_of_one_step_claims_no_trend_and_says_compilation_is_included(tiny_run):
    result = tiny_run[0]
    one = dataclasses.replace(
        result, losses=result.losses[:1], step_seconds=result.step_seconds[:1]
    )
    first_line = summary(one).splitlines()[0]
    assert "over 1 steps (one step: no trend)" in first_line
    assert "for the one step, compilation included" in first_line
    assert "after the first" not in first_line and "did NOT" not in first_line


def test_demo_with_tensor_parallelism_passes_its_checks():
    """``--tp 2``: 2 pipeline devices, each stage's MLPs split over a 'tp' axis of 2, adamw
    with a decay mask through per_leaf on the split params; both checks pass."""
    config = dataclasses.replace(TINY, devices=2, tp=2, steps=3, out_dir=None, layers=2)
    reports = []
    result = run_demo(config, on_report=reports.append)
    assert "split over the 2 devices of tensor axis 'tp'" in reports[0]
    assert result.first_step.passed and result.final is not None and result.final.passed
    assert result.loss_decreased


def test_demo_tp_needs_the_devices(capsys):
    assert main(["demo", "--devices", "8", "--tp", "2"]) == 2
    assert "--devices 8 x --tp 2" in capsys.readouterr().err
    assert main(["demo", "--tp", "0"]) == 2
    assert "--tp 0" in capsys.readouterr().err
