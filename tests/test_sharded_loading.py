"""load_target(mesh=...) puts weights from host memory straight into their shards (and starts no
CPU kernel build: the kernels serve no mesh)."""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import numpy as np
from hsd_jax import cpu_kernels, generate, load_target, sharding
from tests.helpers import save_hf_dir, tiny_target
path = sys.argv[1]
prebuilds, prebuild = [], cpu_kernels.prebuild
cpu_kernels.prebuild = lambda: prebuilds.append(1) or prebuild()
save_hf_dir(tiny_target(vocab=64, hidden=32, heads=4, kv_heads=2), path)
mesh = sharding.make_mesh(data=2, model=2)
sharded = load_target(path, tokenizer=False, mesh=mesh)
after_sharded = len(prebuilds)
plain = load_target(path, tokenizer=False)
q = sharded.params["layers"]["q_proj"]["kernel"]
prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
print(json.dumps({
    "spec": str(q.sharding.spec), "global": list(q.shape),
    "shard_shapes": sorted({tuple(s.data.shape) for s in q.addressable_shards}),
    "devices": len({s.device for s in q.addressable_shards}),
    "prebuilds": [after_sharded, len(prebuilds)],
    "same": [r.token_ids for r in generate(sharded, prompts, max_new_tokens=12, mesh=mesh)]
            == [r.token_ids for r in generate(plain, prompts, max_new_tokens=12)],
}))
"""


def test_load_target_with_mesh_shards_weights(tmp_path):
    from tests.helpers import child_xla_flags

    env = dict(os.environ, XLA_FLAGS=child_xla_flags(4), JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "m")], capture_output=True, text=True,
                       timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "model" in out["spec"] and out["devices"] == 4
    assert out["shard_shapes"] == [[2, 32, 16]] and out["global"] == [2, 32, 32]
    assert out["same"] is True
    assert out["prebuilds"] == [0, 1]
