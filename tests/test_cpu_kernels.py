"""The CPU kernel for the target's layer matmuls (hsd_jax.cpu_kernels): equal to XLA's dot,
used by `generate` with the same tokens, and a clean fallback when it cannot be built."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import api, cpu_kernels, generate, load_drafter
from tests.helpers import tiny_target

built = pytest.mark.skipif(not cpu_kernels.enabled(), reason="the CPU kernel could not be built here")


@built
def test_stacked_matmul_equals_the_dot_for_every_row_count_and_layer():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (3, 64, 96)).astype(np.float32)
    packed = jnp.asarray(cpu_kernels.pack(w))
    run = jax.jit(cpu_kernels.stacked_matmul)
    for n in (1, 2, 3, 5, 8, 9, 16):
        x = rng.normal(0, 1, (n, 64)).astype(np.float32)
        for layer in range(3):
            np.testing.assert_allclose(np.asarray(run(x, packed, layer)), x @ w[layer], rtol=1e-5, atol=1e-5)


@built
def test_generate_uses_the_kernel_with_the_same_tokens(monkeypatch):
    t = tiny_target(vocab=64)
    d = load_drafter("hsd", target=t, random_init=True, seed=1)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (2, 9, 17)]
    spec = dict(method="hsd", drafter=d, tree_nodes=6, tree_depth=3, tree_top_k=2)
    texts = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("HSD_CPU_KERNELS", flag)
        api._COMPILED.clear()
        ar = [r.token_ids for r in generate(t, prompts, max_new_tokens=24)]
        hsd = [r.token_ids for r in generate(t, prompts, max_new_tokens=24, **spec)]
        assert hsd == ar
        texts[flag] = (ar, [exe.as_text() for exe in api._COMPILED.values()])
    assert texts["0"][0] == texts["1"][0]
    assert all(cpu_kernels.TARGET not in txt for txt in texts["0"][1])
    assert all(cpu_kernels.TARGET in txt for txt in texts["1"][1])     # decode and verify both run it


def test_a_failed_build_falls_back_to_xla_with_one_warning(tmp_path):
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from hsd_jax import cpu_kernels, generate\n"
            "from tests.helpers import tiny_target\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    on = cpu_kernels.enabled(); cpu_kernels.enabled()\n"
            "    out = generate(tiny_target(vocab=64), [[1, 2, 3]], max_new_tokens=5)[0].token_ids\n"
            "print(on, len(out), sum('CPU kernel unavailable' in str(x.message) for x in w))\n")
    env = dict(os.environ, CXX="/bin/false", HSD_JAX_CACHE=str(tmp_path), JAX_PLATFORMS="cpu", HSD_CPU_KERNELS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "5", "1"]
