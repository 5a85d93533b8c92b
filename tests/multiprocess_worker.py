"""One process of ``test_multiprocess.py``: a pipeline over two processes through jax.distributed.

Run as ``python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON [HANG_S]``. Each
process has 2 CPU devices and joins the others over gloo; the 4 devices form a (pp=2, data=2)
mesh twice: with the pp axis across the processes (every ppermute crosses them) and with the
data axis across them (the gradient mean crosses them, and each process loads only its half of
the batch). Every case's loss and gradients are compared with ``jax.value_and_grad`` of the
unpipelined loss on this process's first device; the results go to OUT_JSON. Each finished case
is printed as it ends, and a process still running after HANG_S seconds (default 240) prints
every thread's stack and exits, so the log of a hang says where it hung.
"""

from __future__ import annotations

import faulthandler
import json
import sys

import jax

process_id, num_processes, port, out_path = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    sys.argv[3],
    sys.argv[4],
)
faulthandler.dump_traceback_later(float(sys.argv[5]) if len(sys.argv) > 5 else 240.0, exit=True)
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=120,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import zbjax  # noqa: E402
from models import mlp  # noqa: E402

MICROBATCHES = 4
ROWS = 32


def max_error(grads, reference) -> float:
    """Returns the largest absolute difference between two grad trees (global arrays first)."""
    got = [np.asarray(g.addressable_data(0)) for g in jax.tree.leaves(grads)]
    want = [np.asarray(r) for r in jax.tree.leaves(reference)]
    return max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))


def process_local(mesh: Mesh, batch):
    """Returns ``batch`` as a global array sharded over "data", built from this process's rows
    only, as a multi-host input pipeline makes it (the data axis must span the processes)."""
    half = ROWS // num_processes
    rows = slice(process_id * half, (process_id + 1) * half)
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x[rows], x.shape), batch
    )


def record(results: list[dict], result: dict) -> None:
    """Appends ``result`` and prints that its case ended (the log shows how far a hang got)."""
    results.append(result)
    print(f"done: {result['case']} (max grad error {result['max_grad_error']:.3g})", flush=True)


def main() -> None:
    cfg = mlp.MLPConfig(in_dim=8, width=16, depth=4, out_dim=8, stage_boundaries=())
    loss_fn = mlp.make_loss_fn(cfg)
    # Every process builds the same params and batch from the same keys.
    params = jax.tree.map(np.asarray, mlp.init_params(jax.random.key(0), cfg))
    batch = jax.tree.map(np.asarray, mlp.make_batch(jax.random.key(1), cfg, ROWS))
    local = jax.local_devices()[0]
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(
        jax.device_put(params, local), jax.device_put(batch, local)
    )
    devices = np.array(jax.devices())  # process 0's two devices, then process 1's
    meshes = {
        "pp across processes": Mesh(devices.reshape(2, 2), ("pp", "data")),
        "data across processes": Mesh(devices.reshape(2, 2).T, ("pp", "data")),
    }
    results = []
    for mesh_name, mesh in meshes.items():
        for schedule in ("1f1b", "zb-h2", "zb-v"):
            pipe = zbjax.pipeline(
                loss_fn, mesh=mesh, schedule=schedule, num_microbatches=MICROBATCHES
            )
            staged = pipe.stage(params, batch)
            inputs = {"user params": (params, batch), "staged params": (staged, batch)}
            if mesh_name == "data across processes":
                inputs["process-local batch"] = (staged, process_local(mesh, batch))
            for input_name, (p, b) in inputs.items():
                loss, grads = pipe.value_and_grad(p, b)
                if p is staged:
                    grads = pipe.unstage(grads)
                record(
                    results,
                    {
                        "case": f"{mesh_name}, {schedule}, {input_name}",
                        "loss": float(loss),
                        "reference_loss": float(ref_loss),
                        "max_grad_error": max_error(grads, ref_grads),
                    },
                )
    # Params given as global arrays (as a multi-host init makes them) staged, then 20 steps,
    # each taking its grads' global norm and unstaging them, then reading its loss (unstaging
    # slice by slice queued dozens of programs over both processes: a hang,
    # benchmarks/multiprocess_unstage.py; the norm op by op 14 for a small GPT).
    mesh = meshes["data across processes"]
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=MICROBATCHES)
    everywhere = NamedSharding(mesh, PartitionSpec())
    staged = pipe.stage(jax.tree.map(lambda x: jax.device_put(x, everywhere), params), batch)
    for _ in range(20):
        loss, grads = pipe.value_and_grad(staged, batch)
        norm = pipe.global_norm(grads)
        grads = pipe.unstage(grads)
        float(loss)
    record(
        results,
        {
            "case": "data across processes, zb-h2, global params staged, 20 steps",
            "loss": float(loss),
            "reference_loss": float(ref_loss),
            "max_grad_error": max_error(grads, ref_grads),
            "norm_error": abs(float(norm) - float(optax.tree.norm(ref_grads))),
        },
    )
    # Each process planning with costs of its own (as pipe.measure_costs gives them: its own
    # timings) would build another program; every process runs process 0's plan. The first
    # build happens under jax.jit, as in a jitted train step.
    mesh = meshes["pp across processes"]
    own = zbjax.schedules.Costs(f=(1.0 + process_id, 1.0), b=(1.0, 2.0 - process_id), w=0.5)
    for schedule in ("zb-h2", "zb-auto"):
        pipe = zbjax.pipeline(
            loss_fn, mesh=mesh, schedule=schedule, num_microbatches=MICROBATCHES, costs=own
        )
        loss, grads = jax.jit(pipe.value_and_grad)(params, batch)
        record(
            results,
            {
                "case": f"pp across processes, {schedule}, each process's own costs",
                "loss": float(loss),
                "reference_loss": float(ref_loss),
                "max_grad_error": max_error(grads, ref_grads),
                "schedule": str(pipe.schedule.actions),
            },
        )
    # Processes that build different pipelines are told so, each of them, before any exchange.
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=2 + 2 * process_id)
    try:
        pipe.value_and_grad(params, batch)
        mismatch = "ran"
    except zbjax.PipelineError as err:
        mismatch = str(err)
    print("done: processes that build different pipelines", flush=True)
    one_differs = calls_where_one_process_differs(loss_fn, params, batch, mesh, ref_loss)
    print("done: calls where one process differs", flush=True)
    with open(out_path, "w") as f:
        json.dump(
            {
                "process_id": process_id,
                "results": results,
                "mismatch": mismatch,
                "one_differs": one_differs,
            },
            f,
        )


def calls_where_one_process_differs(loss_fn, params, batch, mesh, ref_loss) -> dict[str, str]:
    """Returns what each call where process 1 differs from process 0 gave this process: the
    loss's difference from the reference where it ran, else the error (type and message)."""
    out = {}

    def attempt(name, call):
        try:
            out[name] = f"ran: {abs(float(call()) - float(ref_loss)):.3g}"
        except Exception as err:  # each process reports what it got
            out[name] = f"{type(err).__name__}: {err}"

    def pipe(**kwargs):
        kwargs = {"schedule": "zb-h2", "num_microbatches": MICROBATCHES, **kwargs}
        return zbjax.pipeline(loss_fn, mesh=mesh, **kwargs)

    # Process 1's loss_fn reads a batch key there is not: a KeyError there while tracing;
    # process 0 is told at once (it waited at the build's exchange for process 1).
    def broken(p, b):
        return loss_fn(p, {"x": b["x"], "y": b["no such key"]})

    failing = zbjax.pipeline(
        broken if process_id == 1 else loss_fn,
        mesh=mesh,
        schedule="zb-h2",
        num_microbatches=MICROBATCHES,
    )
    attempt("a KeyError on process 1", lambda: failing.value_and_grad(params, batch)[0])
    # Process 1's params hold one more leaf (unused): another staged layout.
    more = dict(params, extra=np.zeros(3, np.float32)) if process_id == 1 else params
    attempt("another params tree", lambda: pipe().value_and_grad(more, batch)[0])
    # A second step where process 1 passes half the batch: it alone would build anew.
    later = pipe()
    later.value_and_grad(params, batch)
    half = jax.tree.map(lambda x: x[: ROWS // 2], batch) if process_id == 1 else batch
    attempt("another batch shape at step 2", lambda: later.value_and_grad(params, half)[0])
    # Another schedule asked for on process 1 (process 0's would run there).
    other = pipe(schedule="zb-h1" if process_id == 1 else "zb-h2")
    attempt("another schedule", lambda: other.value_and_grad(params, batch)[0])
    # Process 0 alone measures costs and lowers a built step (as a script printing on process
    # 0 does); then both run a step, their exchanges still in step.
    if process_id == 0:
        later.measure_costs(params, batch, repeats=1)
        later.lower(params, batch)
    attempt("a step after process 0 alone measured", lambda: later.value_and_grad(params, batch)[0])
    # Process 1 alone calls inside jax.set_mesh of another mesh: refused before any exchange;
    # process 0 is told at its call's exchange, and the next step runs on both.
    context = jax.make_mesh((2,), ("x",), devices=jax.local_devices())
    refused = pipe()
    refused.value_and_grad(params, batch)
    if process_id == 1:
        with jax.set_mesh(context):
            attempt("refused on process 1 alone", lambda: refused.value_and_grad(params, batch)[0])
    else:
        attempt("refused on process 1 alone", lambda: refused.value_and_grad(params, batch)[0])
    attempt("the step after", lambda: refused.value_and_grad(params, batch)[0])
    # Another schedule with another stage count on process 1 (zb-v: 2 stages per device).
    other_count = pipe(schedule="zb-v" if process_id == 1 else "1f1b")
    attempt("another stage count", lambda: other_count.value_and_grad(params, batch)[0])
    # Params whose tree holds a function as static data (its repr holds a memory address).
    tagged = jax.tree_util.Partial(jnp.tanh, params)
    attempt(
        "a function in the params tree",
        lambda: zbjax.pipeline(
            lambda p, b: loss_fn(p.args[0], b),
            mesh=mesh,
            schedule="zb-h2",
            num_microbatches=MICROBATCHES,
        ).value_and_grad(tagged, batch)[0],
    )
    # Params committed to one of this process's devices, staged on the mesh over both.
    local = jax.device_put(params, jax.local_devices()[0])
    staging = pipe()
    attempt(
        "params on a local device staged",
        lambda: staging.value_and_grad(staging.stage(local, batch), batch)[0],
    )
    # costs= given to process 0 only: every process plans with them.
    costs = zbjax.schedules.Costs(f=(1.0, 1.0), b=(1.0, 1.0), w=0.5) if process_id == 0 else None
    attempt("costs on process 0 only", lambda: pipe(costs=costs).value_and_grad(params, batch)[0])
    # measure_costs of global arrays (a process-local batch, params replicated over both).
    data_mesh = Mesh(np.array(jax.devices()).reshape(2, 2).T, ("pp", "data"))
    measured = zbjax.pipeline(
        loss_fn, mesh=data_mesh, schedule="zb-h2", num_microbatches=MICROBATCHES
    )
    everywhere = NamedSharding(data_mesh, PartitionSpec())
    global_params = jax.tree.map(lambda x: jax.device_put(x, everywhere), params)
    costs = measured.measure_costs(global_params, process_local(data_mesh, batch), comm=False)
    out["measure_costs of global arrays"] = f"stages {len(costs.f)}, min {min(costs.f):.3g}"
    # ... and of a typed PRNG key replicated over both (a loss_fn taking a key).
    keyed = zbjax.pipeline(
        lambda p, b, key: loss_fn(p, b) + 0.0 * jax.random.normal(key),
        mesh=data_mesh,
        schedule="zb-h2",
        num_microbatches=MICROBATCHES,
    )
    key = jax.jit(lambda: jax.random.key(2), out_shardings=everywhere)()
    costs = keyed.measure_costs(params, batch, key, comm=False)
    out["measure_costs of a global key"] = f"stages {len(costs.f)}, min {min(costs.f):.3g}"
    return out


if __name__ == "__main__":
    main()
