"""Gives every test 8 fake CPU devices; runs before any JAX computation.

Property tests draw the same examples on every run (hypothesis profile "ci", derandomized),
so a CI failure reproduces; ``HYPOTHESIS_PROFILE=explore`` draws new ones each run.

Tests compile with ``jax_disable_most_optimizations`` (XLA's LLVM backend at -O0, without its
expensive passes) and, where this jaxlib knows the flag, ``--xla_cpu_use_fusion_emitters=false``
(XLA:CPU emits fused loops with its older element-by-element emitter). Their models are tiny, so
the suite's time is almost all compiling: the first cuts a compile by about a third, the second
the compile of a pipelined step by about two fifths more (a p = 4 zb-v GPT step: 8.3 s to
4.3-5.1 s), and the whole suite went from 1368 s to 646 s on 2 cores. Both change how XLA
generates kernels, not what the program computes, so the tests check the same results a user's
optimized compile gives. Subprocesses (the README example, the multiprocess workers, the
benchmarks' smoke runs) inherit both through the environment. XLA aborts a process that sets a
flag it does not know, so a subprocess tries the flag first (once: the result is kept in
``ZBJAX_TEST_XLA_FLAGS`` for the workers).
"""

import os
import subprocess
import sys

#: XLA flags that make the suite's compiles faster, each set where this jaxlib accepts it.
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def _xla_accepts(flag: str) -> bool:
    """Returns whether a fresh process starts JAX's CPU backend with ``flag`` in XLA_FLAGS
    (within two minutes; a probe that takes longer counts as a refusal)."""
    env = dict(os.environ, XLA_FLAGS=flag)
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        done = subprocess.run(probe, env=env, capture_output=True, check=False, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


if "ZBJAX_TEST_XLA_FLAGS" not in os.environ:
    os.environ["ZBJAX_TEST_XLA_FLAGS"] = " ".join(f for f in FAST_COMPILE_FLAGS if _xla_accepts(f))
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in os.environ["ZBJAX_TEST_XLA_FLAGS"].split():
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")

import jax  # noqa: E402 (after XLA_FLAGS, which the backend reads when it starts)
from hypothesis import settings  # noqa: E402

from zbjax.cpu import use_cpu_devices  # noqa: E402

use_cpu_devices(8)
jax.config.update("jax_disable_most_optimizations", True)

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
