"""Fake CPU devices for tests, demos and benchmarks on one host."""

from __future__ import annotations

import os

import jax

#: Seconds a CPU collective may wait for every device thread. XLA's default (40 s) aborts the
#: process when a loaded machine runs 8 fake devices on 2 cores and one thread is starved.
COLLECTIVE_TIMEOUT_S = 600


def use_cpu_devices(num_devices: int) -> bool:
    """Returns whether JAX will start with ``num_devices`` CPU devices.

    Must run before the first JAX computation; afterwards the backend is fixed and this returns
    False, changing nothing. It also raises XLA's CPU collective timeouts so that fake devices
    sharing few cores wait for each other instead of aborting the process, and turns off the
    CPU client's asynchronous dispatch. With that dispatch on, a test's eager ``jax.value_and_grad``
    reference computed right after a pipelined step hung with every thread of the process
    waiting (jax 0.10.2) or aborted inside XLA (0.11.2), about once per whole test run, which
    looks like JAX's known hang in that dispatch (jax-ml/jax#25861).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags:
        flags += (
            f" --xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TIMEOUT_S}"
            " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
        )
        os.environ["XLA_FLAGS"] = flags.strip()
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:  # the backend is already running
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
