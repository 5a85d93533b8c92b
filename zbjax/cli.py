"""The ``zbjax`` command line: build, simulate and draw pipeline schedules.

Each subcommand is one ``_cmd_*`` function taking the parsed arguments and returning the exit
status, plus one ``_add_*_parser`` function that declares its arguments; ``SUBCOMMANDS`` lists
the parser functions. Wrong input (sizes, costs, names, limits) prints one line on stderr naming
the value and exits with status 2, like argparse's own usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from zbjax.errors import ZbjaxError

#: Schedules that put several model stages (chunks) on each device: stages per device.
STAGES_PER_DEVICE: dict[str, int] = {"zb-v": 2, "interleaved-1f1b": 2}

USAGE_ERROR = 2


class UsageError(ZbjaxError, ValueError):
    """A command-line value is wrong; the message names it and says what to give instead."""


def parse_costs(text: str) -> tuple[float, float, float, float]:
    """Returns (f, b, w, comm) from ``"F,B,W,COMM"`` (``COMM`` may be left out: 0)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4):
        raise UsageError(
            f"--costs {text!r} has {len(parts)} values; give F,B,W or F,B,W,COMM (3 or 4 "
            "comma-separated numbers; COMM defaults to 0), e.g. --costs 1,1,1,0"
        )
    values = []
    for name, part in zip(("F", "B", "W", "COMM"), parts, strict=False):
        try:
            value = float(part)
        except ValueError:
            raise UsageError(
                f"--costs {text!r}: {name} = {part!r} is not a number; give F,B,W,COMM, "
                "e.g. --costs 1,1,1,0"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(
                f"--costs {text!r}: {name} = {part} is negative or not finite; costs must be "
                "finite numbers >= 0"
            )
        values.append(value)
    if len(values) == 3:
        values.append(0.0)
    if values[0] + values[1] + values[2] == 0:
        raise UsageError(f"--costs {text!r}: F, B and W are all 0; give at least one time > 0")
    return (values[0], values[1], values[2], values[3])


def default_num_stages(name: str, num_devices: int) -> int:
    """Returns the stage count ``name`` implies on ``num_devices`` devices (2p for zb-v and
    interleaved-1f1b, else p)."""
    return STAGES_PER_DEVICE.get(name, 1) * num_devices


def schedule_summary(schedule: Any, result: Any, costs: Any) -> dict[str, Any]:
    """Returns the JSON-ready description of a simulated schedule that ``--json`` prints."""
    from zbjax.schedules import span_bubble_rate

    return {
        "name": schedule.name,
        "num_stages": schedule.num_stages,
        "num_devices": schedule.num_devices,
        "num_microbatches": schedule.num_microbatches,
        "makespan": result.makespan,
        "bubble_rate": result.bubble_rate,
        "span_bubble_rate": span_bubble_rate(schedule, result),
        "peak_memory": list(result.peak_memory),
        "busy": list(result.busy),
        "placement": list(schedule.placement),
        "edges": [list(e) for e in schedule.edges],
        "stage_names": list(schedule.stage_names) if schedule.stage_names else None,
        # JSON has no infinity: no limit (None, or inf as given) is null.
        "mem_limit": schedule.mem_limit if math.isfinite(schedule.mem_limit or math.inf) else None,
        "w_mem": schedule.w_mem,
        "costs": {
            "f": costs.f,
            "b": costs.b,
            "w": costs.w,
            "comm": costs.comm,
            **({} if costs.bw is None else {"bw": costs.bw}),
        },
        "actions": [[str(a) for a in program] for program in schedule.actions],
    }


def parse_edges(text: str) -> tuple[tuple[int, int], ...]:
    """Returns stage-graph edges from ``"0-1,0-2,1-3,2-3"`` (src-dst pairs)."""
    edges = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        src, sep, dst = part.partition("-")
        if not sep or not src.strip().isdigit() or not dst.strip().isdigit():
            raise UsageError(
                f"--edges {text!r}: {part!r} is not SRC-DST; give stage pairs like "
                "--edges 0-1,0-2,1-3,2-3"
            )
        edges.append((int(src), int(dst)))
    if not edges:
        raise UsageError(f"--edges {text!r} names no edge; give pairs like --edges 0-1,1-2")
    return tuple(edges)


def parse_ints(flag: str, text: str) -> tuple[int, ...]:
    """Returns the comma-separated non-negative integers of ``text`` (for ``flag``)."""
    try:
        values = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise UsageError(
            f"{flag} {text!r}: give comma-separated integers, e.g. {flag} 0,1,2,3"
        ) from None
    if any(v < 0 for v in values):
        raise UsageError(f"{flag} {text!r}: values must be >= 0")
    return values


def _dag_options(args: argparse.Namespace) -> dict[str, Any]:
    """Returns build() options for a DAG schedule from --edges/--placement/--stage-names."""
    if args.edges is None:
        if args.placement or args.stage_names:
            raise UsageError("--placement and --stage-names go with --edges (a stage DAG)")
        return {}
    edges = parse_edges(args.edges)
    num_stages = max(max(e) for e in edges) + 1
    if args.stages is not None and args.stages != num_stages:
        raise UsageError(
            f"--stages {args.stages} but --edges name {num_stages} stages (0..{num_stages - 1}); "
            "leave --stages out with --edges, or fix the edges"
        )
    if args.placement:
        placement = parse_ints("--placement", args.placement)
        if len(placement) != num_stages:
            raise UsageError(
                f"--placement gives {len(placement)} devices for the {num_stages} stages the "
                "edges name; give one device per stage"
            )
        if max(placement) + 1 != args.p:
            raise UsageError(
                f"--placement uses devices 0..{max(placement)} ({max(placement) + 1} devices) "
                f"but -p is {args.p}; make them agree"
            )
    elif num_stages == args.p:
        placement = tuple(range(num_stages))
    else:
        raise UsageError(
            f"--edges name {num_stages} stages but -p is {args.p}; give --placement with the "
            "device of each stage, or one stage per device"
        )
    options: dict[str, Any] = {"edges": edges, "placement": placement}
    if args.stage_names:
        names = tuple(n.strip() for n in args.stage_names.split(","))
        if len(names) != len(placement):
            raise UsageError(
                f"--stage-names has {len(names)} names for {len(placement)} stages; give one each"
            )
        options["stage_names"] = names
    return options


def _auto_options(args: argparse.Namespace) -> dict[str, Any]:
    """Returns build() options for zb-auto: its stage DAG from --edges (one stage per device,
    stage s on device s), or none for a chain."""
    if args.edges is None:
        return {}
    if args.placement or args.stage_names:
        raise UsageError(
            "zb-auto puts stage s on device s: give --edges only, without --placement and "
            "--stage-names (those go with dag-1f1b and dag-zb)"
        )
    edges = parse_edges(args.edges)
    num_stages = max(max(e) for e in edges) + 1
    if num_stages != args.p or args.stages not in (None, num_stages):
        raise UsageError(
            f"--edges name {num_stages} stages (0..{num_stages - 1}) but -p is {args.p}"
            + (f" and --stages {args.stages}" if args.stages is not None else "")
            + "; zb-auto runs one stage per device, so give -p equal to the stage count"
        )
    return {"edges": edges}


def _check_positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} {value}: it must be at least 1")


#: The most (stage, microbatch) pairs ``zbjax schedule`` builds and simulates: 100,000 take
#: about 5 s on 2 cores, and memory grows with them (-m 10**20 grew past 22 GB unchecked).
MAX_PAIRS = 1_000_000


def _check_size(num_stages: int, num_microbatches: int) -> None:
    if num_stages * num_microbatches > MAX_PAIRS:
        raise UsageError(
            f"{num_stages} stages x {num_microbatches} microbatches is more than zbjax schedule "
            f"builds (at most {MAX_PAIRS:,} stage-microbatch pairs: it simulates every action); "
            "use a smaller -p / --stages or -m"
        )


#: DemoConfig fields whose flag is not ``--`` and the field name with dashes.
_DEMO_FLAGS = {"out_dir": "--out", "profile_dir": "--profile"}
_DEMO_FIELD = re.compile(
    r"\b(schedule|devices|tp|stages|microbatches|layers|width|heads|steps|batch_size|seq_len"
    r"|lr|seed|out_dir|profile_dir)="
)


def _demo_flags(message: str) -> str:
    """Returns a demo error with ``field=value`` written as the flag (``--batch-size 32``),
    leaving quoted values alone (a path such as 'runs/lr=3e-4' is the user's)."""

    def flag(match: re.Match) -> str:
        name = match.group(1)
        return _DEMO_FLAGS.get(name, "--" + name.replace("_", "-")) + " "

    # Odd pieces of the split are the quoted values, as repr() writes them.
    pieces = re.split(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""", message)
    return "".join(p if i % 2 else _DEMO_FIELD.sub(flag, p) for i, p in enumerate(pieces))


#: The schedule builder's argument names, as ``zbjax schedule``'s flags.
_SCHEDULE_FLAGS = {"num_stages": "--stages", "num_devices": "-p", "mem_limit": "--mem-limit"}


def _schedule_flags(message: str) -> str:
    """Returns a schedule error with a legend of the argument names it uses as flags."""
    named = [f"{name} is {flag}" for name, flag in _SCHEDULE_FLAGS.items() if name in message]
    return f"{message} ({', '.join(named)})" if named else message


def _check_image_format(path: str) -> None:
    """Raises UsageError unless matplotlib writes ``path``'s file type (no suffix: PNG)."""
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if not suffix:
        return
    from matplotlib.figure import Figure

    known = Figure().canvas.get_supported_filetypes()
    if suffix not in known:
        raise UsageError(
            f"--plot {path!r}: matplotlib writes no {suffix!r} files; give one of "
            f"{', '.join(sorted(known))} (e.g. chart.png)"
        )


def _writing(flag: str, path: Any, write: Callable[[], Any]) -> None:
    """Runs ``write``, naming ``flag`` and ``path`` in the error if it cannot write there (a
    folder without write access, or a file type matplotlib does not know)."""
    try:
        write()
    except OSError as err:
        raise UsageError(f"{flag} {str(path)!r}: {err.strerror or err}") from None
    except ValueError as err:
        raise UsageError(f"{flag} {str(path)!r}: {err}") from None


def _cmd_schedule(args: argparse.Namespace) -> int:
    """Builds, validates and simulates one schedule; prints it; writes --plot/--trace files."""
    from zbjax import schedules
    from zbjax.schedules.plot import make_parent_folder, output_path

    _check_positive("-p", args.p)
    _check_positive("-m", args.m)
    _check_positive("--stages", args.stages)
    if args.mem_limit is not None and not args.mem_limit > 0:
        raise UsageError(f"--mem-limit {args.mem_limit}: it must be > 0 (in units of M_B)")
    if not 0 <= args.w_mem <= 1:
        raise UsageError(f"--w-mem {args.w_mem}: it must lie in [0, 1] (a fraction of M_B)")
    f, b, w, comm = parse_costs(args.costs) if args.costs else (1.0, 1.0, 1.0, 0.0)
    costs = schedules.Costs(f=f, b=b, w=w, comm=comm)
    takes_edges = (*schedules.DAG_SCHEDULE_NAMES, "zb-auto")
    if args.edges is not None and args.name not in takes_edges:
        raise UsageError(
            f"--edges goes with the DAG schedules {', '.join(schedules.DAG_SCHEDULE_NAMES)} "
            f"and zb-auto, not {args.name}"
        )
    # The paths are checked now and their folders made once the schedule is built.
    plot = trace = None
    if args.plot is not None:
        plot = output_path(args.plot, "--plot", ".png", add_suffix=True, make_folder=False)
        _check_image_format(args.plot)
    if args.trace is not None:
        trace = output_path(args.trace, "--trace", ".json", make_folder=False)
    if plot is not None and trace is not None and plot.resolve() == trace.resolve():
        raise UsageError(f"--plot and --trace both name {str(plot)!r}; give them different files")
    options = _auto_options(args) if args.name == "zb-auto" else _dag_options(args)
    if args.name in schedules.DAG_SCHEDULE_NAMES and not options:
        raise UsageError(
            f"{args.name} runs on a stage DAG: give --edges (e.g. --edges 0-1,0-2,1-3,2-3) "
            "and optionally --placement and --stage-names"
        )
    if "placement" in options:
        num_stages = len(options["placement"])
        num_devices = None
    else:
        num_stages = args.stages or default_num_stages(args.name, args.p)
        num_devices = args.p
    _check_size(num_stages, args.m)
    try:
        schedule = schedules.build(
            args.name,
            num_stages,
            args.m,
            num_devices=num_devices,
            costs=costs,
            mem_limit=args.mem_limit,
            w_mem=args.w_mem,
            **options,
        )
    except ZbjaxError as err:
        raise UsageError(_schedule_flags(str(err))) from None
    schedules.validate(schedule)
    result = schedules.simulate(schedule, costs)

    for flag, path in (("--plot", plot), ("--trace", trace)):
        if path is not None:
            make_parent_folder(path, flag)
    if plot is not None:
        from zbjax.schedules.plot import gantt

        _writing("--plot", plot, lambda: gantt(schedule, costs, path=plot))
    if trace is not None:
        from zbjax.schedules.plot import write_trace

        _writing("--trace", trace, lambda: write_trace(schedule, trace, costs))

    if args.json:
        print(json.dumps(schedule_summary(schedule, result, costs), allow_nan=False))
        return 0
    from zbjax.schedules.plot import text_grid

    print(
        f"{schedule.name}: {schedule.num_devices} devices, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches"
    )
    print(text_grid(schedule, result))
    print(f"makespan     {result.makespan:g}")
    print(f"bubble rate  {result.bubble_rate:.4f} ({result.bubble_rate:.1%}) of one step")
    span_rate = schedules.span_bubble_rate(schedule, result)
    print(f"span bubble  {span_rate:.4f} ({span_rate:.1%}) of back-to-back steps (the paper's)")
    peaks = " ".join(f"{m:g}" for m in result.peak_memory)
    print(f"peak memory  {peaks}  (M_B per device, w_mem={schedule.w_mem:g})")
    for flag, path in (("gantt chart", plot), ("trace", trace)):
        if path is not None:
            print(f"wrote {flag} to {path}")
    return 0


def _add_schedule_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "schedule",
        help="build, simulate and draw a pipeline schedule",
        description=(
            "Build a pipeline schedule, simulate it and print its grid, makespan, bubble rate "
            "and peak activation memory per device (in M_B, one microbatch's activation on one "
            "stage)."
        ),
    )
    parser.add_argument("name", help="schedule name, e.g. gpipe, 1f1b, zb-h1, zb-v, zb-auto")
    parser.add_argument("-p", type=int, required=True, help="number of pipeline devices")
    parser.add_argument("-m", type=int, required=True, help="number of microbatches")
    parser.add_argument(
        "--stages",
        type=int,
        default=None,
        help="number of model stages (default: p, or 2p for zb-v and interleaved-1f1b)",
    )
    parser.add_argument(
        "--costs",
        default=None,
        metavar="F,B,W,COMM",
        help="time of F, B, W per stage and microbatch, and of a send (default 1,1,1,0)",
    )
    parser.add_argument(
        "--mem-limit", type=float, default=None, help="activation memory limit per device (M_B)"
    )
    parser.add_argument(
        "--w-mem", type=float, default=0.5, help="part of M_B that W keeps after B (default 0.5)"
    )
    parser.add_argument(
        "--edges",
        default=None,
        metavar="S-D,...",
        help="stage DAG edges for dag-1f1b, dag-zb and zb-auto, e.g. 0-1,0-2,1-3,2-3",
    )
    parser.add_argument(
        "--placement", default=None, metavar="D,...", help="device of each DAG stage"
    )
    parser.add_argument(
        "--stage-names", default=None, metavar="NAME,...", help="a name for each DAG stage"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--plot", metavar="FILE.png", help="write a Gantt chart PNG")
    parser.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace")
    parser.set_defaults(command=_cmd_schedule)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Trains the reference GPT pipelined, printing report, progress and checks; 1 on FAIL."""
    # The CPU device count must be set before JAX starts its backend, so before anything else.
    from zbjax.demo import request_cpu_devices

    for flag in ("devices", "tp"):
        _check_positive(f"--{flag}", getattr(args, flag))
    request_cpu_devices(args.devices and args.devices * args.tp)
    from zbjax.demo import DemoConfig, Progress, run_demo, summary

    for flag in ("devices", "stages", "microbatches", "layers", "width", "heads", "steps"):
        _check_positive(f"--{flag}", getattr(args, flag))
    _check_positive("--batch-size", args.batch_size)
    _check_positive("--seq-len", args.seq_len)
    config = DemoConfig(
        schedule=args.schedule,
        devices=args.devices,
        tp=args.tp,
        stages=args.stages,
        microbatches=args.microbatches,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        out_dir=args.out,
        profile_dir=args.profile,
        check_final=args.check_final,
    )

    def show_report(report: str) -> None:
        print(report, end="\n\n", flush=True)

    try:
        result = run_demo(config, on_report=show_report, on_step=Progress())
    except ZbjaxError as err:  # the checks name DemoConfig's fields: say the flags instead
        raise UsageError(_demo_flags(str(err))) from None
    print()
    print(summary(result))
    if result.passed:
        print("PASS")
    elif result.diverged:
        reference = result.final.reference_losses if result.final is not None else ()
        also = (
            "; so did the unpipelined reference run"
            if any(not math.isfinite(x) for x in reference)
            else ""
        )
        print(f"FAIL: the training diverged (a non-finite loss){also}; lower --lr")
    else:
        print("FAIL: the pipelined run differs from the reference")
    return 0 if result.passed else 1


def _add_demo_parser(subparsers: Any) -> None:
    from zbjax.demo import DemoConfig

    default = DemoConfig()
    parser = subparsers.add_parser(
        "demo",
        help="train a small GPT pipelined over the devices and check it against JAX",
        description=(
            "Train the reference GPT on a generated character-level corpus, pipelined over a "
            "mesh of 8 fake CPU devices (or the accelerators present; --tp adds tensor "
            "parallelism inside each stage), with optax.adamw "
            "(weight decay on matrices, run per leaf by pipe.per_leaf). "
            "Prints the pipeline report and the progress (in a log, a line per step, or every "
            "steps // 50 steps from 100 steps on), writes the schedule's Gantt chart and "
            "Perfetto trace, and checks the first step's loss and gradients, the final "
            "loss, and the loss on held-out text (pipe.value) against the unpipelined "
            "model. Exits 1 when a check fails."
        ),
    )
    parser.add_argument(
        "--schedule", default=default.schedule, help=f"schedule name (default {default.schedule})"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="pipeline devices (default: all, at most 8, divided by --tp, and no more than "
        "the layers give stages to: 4 for zb-v and interleaved-1f1b with 8 layers)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=default.tp,
        help="tensor-parallel devices per pipeline device: attention (by whole heads), the "
        "MLPs and the embedding split Megatron-style over a 'tp' mesh axis (default 1: none; "
        "devices x tp in all)",
    )
    parser.add_argument(
        "--stages",
        type=int,
        default=None,
        help="model stages (default: devices, or 2 x devices for zb-v and interleaved-1f1b; "
        "dag-1f1b and dag-zb take more stages than devices, placed in contiguous blocks)",
    )
    for flag, value, what in (
        ("--microbatches", default.microbatches, "microbatches per step"),
        ("--layers", default.layers, "transformer blocks"),
        ("--width", default.width, "model width (d_model)"),
        ("--heads", default.heads, "attention heads"),
        ("--steps", default.steps, "training steps"),
        ("--batch-size", default.batch_size, "sequences per step"),
        ("--seq-len", default.seq_len, "characters per sequence"),
        ("--seed", default.seed, "seed of the corpus, the batches and the initial params"),
    ):
        parser.add_argument(flag, type=int, default=value, help=f"{what} (default {value})")
    parser.add_argument(
        "--lr", type=float, default=default.lr, help=f"adamw learning rate (default {default.lr})"
    )
    parser.add_argument(
        "--out",
        default=default.out_dir,
        metavar="DIR",
        help=f"where to write the Gantt PNG and trace (default ./{default.out_dir}/)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a jax.profiler trace of the second and third steps (the first is mostly "
        "compilation; with --steps 1, that one)",
    )
    parser.add_argument(
        "--check-final",
        action=argparse.BooleanOptionalAction,
        default=default.check_final,
        help="also train unpipelined and compare the final loss (default on)",
    )
    parser.set_defaults(command=_cmd_demo)


#: One entry per subcommand: a function that adds its parser (and sets ``command``).
SUBCOMMANDS: list[Callable[[Any], None]] = [_add_schedule_parser, _add_demo_parser]


def build_parser() -> argparse.ArgumentParser:
    """Returns the ``zbjax`` argument parser with every subcommand of ``SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="zbjax", description="Zero-bubble and graph pipeline parallelism for JAX."
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Returns the exit status of running the ``zbjax`` command line on ``argv``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.command(args)
    except BrokenPipeError:
        # The reader of stdout went away (``zbjax schedule ... | head``): stop quietly, with
        # Python's recipe (stdout to devnull, so that flushing it at exit does not fail too).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (ZbjaxError, ValueError) as err:
        print(f"zbjax {args.subcommand}: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except ImportError as err:
        print(f"zbjax {args.subcommand}: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        where = f" {err.filename}" if err.filename else ""
        print(f"zbjax {args.subcommand}: error:{where} {err.strerror or err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
