"""Static cost estimates of jaxprs: exact matmul FLOPs, and a FLOPs-plus-bytes cost model.

Everything here is a pure function of a jaxpr (``jax.extend.core.Jaxpr`` or ``ClosedJaxpr``);
nothing is compiled or run. Sub-jaxprs are followed:

- ``jit``/``pjit``, ``closed_call``, ``core_call``, ``remat``/``checkpoint``,
  ``custom_jvp_call``, ``custom_vjp_call`` (the primal ``call_jaxpr``) and any other primitive
  carrying jaxprs in its params: the sum over those jaxprs;
- ``scan``: the body times ``length``;
- ``while``: the condition and the body counted ONCE each, since the trip count is not known
  statically (a ``fori_loop`` with static bounds under ``jax.grad`` becomes a ``scan`` and is
  counted exactly);
- ``cond``: the maximum over the branches;
- ``shard_map``: the per-shard body times the number of devices over its manual mesh axes, so
  the count is the total work of the program, comparable with the same program unsharded.

``matmul_flops`` is exact and integer (it is what the "no recomputation" tests compare).
``jaxpr_cost`` is the estimate the auto-partitioner balances: matmul FLOPs plus
``bytes_weight()`` times the bytes read and written by every other operation: the weight of
the platform the program will run on (``BYTES_WEIGHT`` on accelerators, ``CPU_BYTES_WEIGHT``
on CPUs; a pipeline estimates with its mesh's, ``costs_for``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

# FLOP-equivalents charged per byte a non-matmul operation reads or writes. A machine's balance
# (peak FLOP/s over memory bandwidth) is ~295 FLOPs/byte on an H100 (989 TFLOP/s bf16, 3.35
# TB/s), ~150 on an A100 and ~240 on a TPU v4: an op moving one byte costs about as much time
# as that many matmul FLOPs. We charge a third of that because counting every op's inputs and
# outputs overstates traffic: XLA fuses chains of elementwise ops into one kernel that reads
# and writes each array once.
BYTES_WEIGHT = 100.0

# The same rule on a CPU, whose balance is far lower: XLA:CPU on the 2-core AMD EPYC of session
# 40 ran matmuls at 214-476 GFLOP/s and fused elementwise chains at 7-54 GB/s, a median
# of 10.6 FLOPs a byte (`python benchmarks/balance.py`), a third of which is 3. Charged 100 on
# CPU, a weight decay term in the loss or the bfloat16 cast of a scanned stack (bytes of
# parameters, no FLOPs) weighed as several layers, and the cut of a scan MLP into 4 stages
# measured F+B+W max/mean 1.83 and 1.86; with 3, 1.30 and 1.43 (a plain one 1.06 either way).
CPU_BYTES_WEIGHT = 3.0

# FLOP-equivalents charged per byte one pipeline device sends to the next (an activation in
# F, its cotangent in B): the automatic cut weighs the bytes crossing a cut with it, since the
# lowering sends every tick's messages in slots as large as the largest edge's. Peak matmul
# FLOP/s over one link's bandwidth, from datasheets (not measured: no GPU was lent): ~2,200 on
# an H100 over NVLink (989 TFLOP/s bf16, 450 GB/s each way), ~1,000 on an A100 (312 TFLOP/s,
# 300 GB/s), several times more between hosts; nothing is fused away from a transfer, so the
# whole balance is charged.
COMM_WEIGHT = 2000.0

# Messages up to this size cost a tick about what an empty one does (the exchange's latency,
# paid wherever the cut goes, dominates): only the bytes beyond it are charged. ~1 MiB is a
# GPU link's latency (some microseconds) times its bandwidth (an estimate, as above).
COMM_FREE_BYTES = 2**20

# The same on a CPU mesh: 4 XLA:CPU devices of the 2-core AMD EPYC of session 41 shifting a
# message around a ring inside a shard_map moved 4.9 GB/s each, where one device ran matmuls
# at a median 335 GFLOP/s: 69 FLOPs a byte (one quiet run of `python benchmarks/balance.py`,
# whose section "balance" shows the latest; four runs measured 63 to 82).
CPU_COMM_WEIGHT = 69.0

# In that run a tick shifting 64 KiB took 55 us, one of 4 KiB 44 us, one of 256 KiB 112 us.
CPU_COMM_FREE_BYTES = 2**16

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "zbjax_cost_platform", default=None
)


def platform_bytes_weight(platform: str) -> float:
    """Returns the FLOPs charged per byte moved on ``platform`` ("cpu", "gpu", "tpu", ...)."""
    return CPU_BYTES_WEIGHT if platform == "cpu" else BYTES_WEIGHT


def platform_comm_weight(platform: str) -> float:
    """Returns the FLOPs charged per byte sent between pipeline devices on ``platform``."""
    return CPU_COMM_WEIGHT if platform == "cpu" else COMM_WEIGHT


def platform_comm_free_bytes(platform: str) -> int:
    """Returns the message bytes on ``platform`` below which a byte sent is not charged."""
    return CPU_COMM_FREE_BYTES if platform == "cpu" else COMM_FREE_BYTES


def _platform() -> str:
    platform = _PLATFORM.get()
    return jax.default_backend() if platform is None else platform


def bytes_weight() -> float:
    """Returns the FLOPs charged per byte moved: that of the platform set by ``costs_for``,
    else of JAX's default backend."""
    return platform_bytes_weight(_platform())


def comm_weight() -> float:
    """Returns the FLOPs charged per byte sent between pipeline devices: that of the platform
    set by ``costs_for``, else of JAX's default backend."""
    return platform_comm_weight(_platform())


def comm_free_bytes() -> int:
    """Returns the message bytes below which a byte sent is not charged, on the platform set
    by ``costs_for``, else on JAX's default backend."""
    return platform_comm_free_bytes(_platform())


@contextlib.contextmanager
def costs_for(platform: str) -> Iterator[None]:
    """Estimates costs for ``platform`` (the devices a pipeline runs on) inside the block."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})

# Operations that move no data once compiled: the stage marker (lowered to its operands) and
# shape-only changes XLA turns into bitcasts.
FREE_PRIMITIVES = frozenset({"stage_boundary", "reshape", "squeeze", "expand_dims"})


def aval_bytes(aval: Any) -> int:
    """Returns the number of bytes of one abstract value (0 for tokens and shapeless values)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * _itemsize(dtype)


def avals_bytes(avals: Iterable[Any]) -> int:
    """Returns the total number of bytes of several abstract values."""
    return sum(aval_bytes(a) for a in avals)


def matmul_flops(jaxpr: Jaxpr | ClosedJaxpr) -> int:
    """Returns the exact FLOPs of the dot_general and conv ops of a jaxpr, sub-jaxprs included.

    A dot_general costs 2*M*N*K per batch element (a multiply and an add per term); a
    convolution 2 * (output elements) * (kernel elements per output feature).
    """
    return sum(equation_matmul_flops(eqn) for eqn in _open(jaxpr).eqns)


def equation_matmul_flops(eqn: Any) -> int:
    """Returns the exact matmul FLOPs of one equation (recursing into its sub-jaxprs)."""
    name = eqn.primitive.name
    if name == "dot_general":
        return _dot_general_flops(eqn)
    if name == "conv_general_dilated":
        return _conv_flops(eqn)
    return int(_combine_sub_jaxprs(eqn, matmul_flops, default=0))


def equation_cost(eqn: Any) -> float:
    """Returns one equation's estimated cost: matmul FLOPs, else ``bytes_weight()`` * bytes moved.

    Bytes moved are the bytes of the equation's inputs plus its outputs. For a ``gather`` (an
    embedding lookup) that is its whole operand although it reads only the rows it selects:
    the charge is kept, as its weight gradient zeroes and scatters into a table of that size,
    and the partitioner balances forward costs as stand-ins for F + B + W. Equations holding
    sub-jaxprs (control flow, calls) cost what their sub-jaxprs cost, combined as described in
    the module docstring.
    """
    name = eqn.primitive.name
    if name in MATMUL_PRIMITIVES:
        return float(equation_matmul_flops(eqn))
    if name in FREE_PRIMITIVES:
        return 0.0
    if any(True for _ in _sub_jaxprs(eqn)):
        return float(_combine_sub_jaxprs(eqn, jaxpr_cost, default=0.0))
    moved = avals_bytes(v.aval for v in eqn.invars) + avals_bytes(v.aval for v in eqn.outvars)
    return bytes_weight() * moved


def jaxpr_cost(jaxpr: Jaxpr | ClosedJaxpr) -> float:
    """Returns the estimated cost of a jaxpr: the sum of ``equation_cost`` over its equations."""
    return float(sum(equation_cost(eqn) for eqn in _open(jaxpr).eqns))


def _open(jaxpr: Jaxpr | ClosedJaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def _itemsize(dtype: Any) -> int:
    # Extended dtypes (PRNG keys) have no numpy itemsize; count their underlying storage.
    try:
        return int(dtype.itemsize)
    except (AttributeError, TypeError):
        impl = getattr(dtype, "_impl", None)
        key_shape = getattr(impl, "key_shape", None)
        return 4 * math.prod(key_shape) if key_shape is not None else 0


def _dot_general_flops(eqn: Any) -> int:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in lhs_contract)
    # The output holds batch x M x N elements; each is a K-term dot product.
    return 2 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _conv_flops(eqn: Any) -> int:
    rhs_shape = eqn.invars[1].aval.shape
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    per_output = math.prod(rhs_shape) // rhs_shape[out_feature_dim]
    return 2 * math.prod(eqn.outvars[0].aval.shape) * per_output


def _sub_jaxprs(eqn: Any) -> Iterator[Jaxpr]:
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def _combine_sub_jaxprs(eqn: Any, measure: Any, default: Any) -> Any:
    name = eqn.primitive.name
    params = eqn.params
    if name == "scan":
        return params["length"] * measure(params["jaxpr"])
    if name == "cond":
        return max((measure(b) for b in params["branches"]), default=default)
    if name == "shard_map":
        return _manual_devices(params) * measure(params["jaxpr"])
    # while (cond + body once), calls, remat, custom_jvp/vjp: the sum over the sub-jaxprs.
    return sum((measure(j) for j in _sub_jaxprs(eqn)), default)


def _manual_devices(params: dict) -> int:
    mesh = params["mesh"]
    axes = params.get("newly_manual_axes", params.get("manual_axes", params.get("axis_names")))
    if axes is None:
        axes = tuple(mesh.shape)
    return math.prod(mesh.shape[a] for a in axes)
