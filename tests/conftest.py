"""Gives every test 8 fake CPU devices; runs before any JAX computation.

Property tests draw the same examples on every run (hypothesis profile "ci", derandomized),
so a CI failure reproduces; ``HYPOTHESIS_PROFILE=explore`` draws new ones each run.
"""

import os

from hypothesis import settings

from zbjax.cpu import use_cpu_devices

use_cpu_devices(8)

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
