"""Gives every test 8 fake CPU devices; runs before any JAX computation.

Property tests draw the same examples on every run (hypothesis profile "ci", derandomized),
so a CI failure reproduces; ``HYPOTHESIS_PROFILE=explore`` draws new ones each run.

Tests compile with ``jax_disable_most_optimizations`` (XLA's LLVM backend at -O0, without its
expensive passes): their models are tiny, so the suite's time is almost all compiling, and this
cuts a compile by about a third. It changes how XLA's kernels are generated, not the HLO program
(its buffers and collectives), so what the tests check is what a user's optimized compile runs.
Subprocesses (the multiprocess tests, the benchmarks' pinned copies) compile fully optimized.
"""

import os

import jax
from hypothesis import settings

from zbjax.cpu import use_cpu_devices

use_cpu_devices(8)
jax.config.update("jax_disable_most_optimizations", True)

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
