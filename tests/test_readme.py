"""The README's train-step example runs as written and trains like the unpipelined step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

CHECK = """
import json
for _ in range(2):
    staged, state, loss, buffers = train_step(staged, state, batch, buffers)
compiles = train_step._cache_size()  # the returned state and arenas are typed as given
# The same two steps unpipelined, with optax's own clipping on the user-layout tree.
ref_opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
ref_params, ref_state = params, ref_opt.init(params)
for _ in range(2):
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(ref_params, batch)
    updates, ref_state = ref_opt.update(ref_grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
pairs = zip(jax.tree.leaves(pipe.unstage(staged)), jax.tree.leaves(ref_params), strict=True)
diff = max(float(abs(a - b).max()) for a, b in pairs)
result = {"loss": float(loss), "ref_loss": float(ref_loss), "diff": diff, "compiles": compiles}
print(json.dumps(result))
"""


def readme_example() -> str:
    """Returns the Python block under the README's "A train step, pipelined" heading."""
    text = README.read_text()
    section = text[text.index("## A train step, pipelined") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_train_step_runs_and_matches_two_unpipelined_steps():
    code = readme_example() + CHECK
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(result["loss"] - result["ref_loss"]) <= 1e-5 * abs(result["ref_loss"])
    assert result["diff"] < 1e-5, result
    assert result["compiles"] == 1, result  # the README says one compile
