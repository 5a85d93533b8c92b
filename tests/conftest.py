"""Gives every test 8 fake CPU devices; runs before any JAX computation."""

from zbjax.cpu import use_cpu_devices

use_cpu_devices(8)
