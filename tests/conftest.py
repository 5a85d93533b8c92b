"""Gives every test 8 fake CPU devices; runs before any JAX computation."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
