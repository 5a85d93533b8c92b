"""Writes one named section of ``benchmarks/RESULTS.md`` so several scripts can share the file.

A section is the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->``; writing it
again replaces it in place and leaves every other section alone.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_PATH = Path(__file__).resolve().with_name("RESULTS.md")

_HEADER = (
    "# zbjax benchmark results\n\n"
    "Each section below is written by one script in `benchmarks/`; the section says which. "
    "Rerun that script to refresh it.\n"
)


def _markers(name: str) -> tuple[str, str]:
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(
            f"section name {name!r} must be letters, digits, '_', '.' or '-' (it goes into an "
            "HTML comment marker)"
        )
    return f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"


def write_section(name: str, body: str, path: str | Path = RESULTS_PATH) -> Path:
    """Returns ``path`` after replacing (or appending) its section ``name`` with ``body``."""
    path = Path(path)
    begin, end = _markers(name)
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else _HEADER
    start = text.find(begin)
    stop = text.find(end, start) if start >= 0 else -1
    if start >= 0 and stop >= 0:
        text = text[:start] + block + text[stop + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    # Write a sibling file and rename it, so a reader never sees half a file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def machine_load() -> str:
    """Returns the output of ``uptime`` (load averages), or a note that it is unavailable."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"load average {os.getloadavg()}"


def save_figure(fig, path: Path) -> Path:
    """Returns ``path`` after saving the matplotlib figure ``fig`` there (laid out, 100 dpi)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pin_to_one_core() -> None:
    """Pins this process to one core; call it before the first JAX computation, so that XLA's
    threads inherit the affinity."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_pinned_copy(script: str, json_flag: str, *args: str) -> Any:
    """Returns the JSON that a copy of ``script``, run with ``args`` and ``json_flag PATH``,
    writes to PATH (the copy pins itself to one core when given that flag)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, script, *args, json_flag, str(out)], check=True)
        return json.loads(out.read_text())


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_worker_flags(parser: Any) -> None:
    """Adds the hidden flags ``launch_workers`` passes to each copy (``--worker``, ``--port``,
    ``--out``) and ``--smoke`` (toy sizes, to check that the script runs) to an argparse
    parser."""
    import argparse

    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)


def launch_workers(script: str, args: Sequence[str], num_workers: int, timeout_s: float) -> Any:
    """Returns the JSON worker 0 writes after running ``num_workers`` copies of ``script`` with
    ``args`` plus ``--worker ID --port PORT --out PATH`` (the copies join each other over
    ``jax.distributed`` at PORT). Raises SystemExit with the reason when a copy fails or runs
    past ``timeout_s`` (then every copy is killed)."""
    if len(os.sched_getaffinity(0)) < num_workers:
        raise SystemExit(f"needs {num_workers} cores to pin one process to each")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    script,
                    *args,
                    "--worker",
                    str(worker),
                    "--port",
                    str(port),
                    "--out",
                    str(out),
                ]  # fmt: skip
            )
            for worker in range(num_workers)
        ]
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise SystemExit(f"a worker ran past {timeout_s} s; all were killed") from None
        if any(codes):
            raise SystemExit(f"workers exited with {codes}")
        return json.loads(out.read_text())
