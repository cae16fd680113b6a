"""The TPU side of the device pack's `scale` table: an ESTIMATE of what a verify of N new tokens (and
so an ar step, N = 1) costs a bigger target on a TPU chip, from the TPU compiler's cost analysis, on a
machine without a TPU (libtpu's deviceless topologies, as `hsd compile --tpu` builds them).

    python benchmarks/device/scale_tpu.py [--tpu v5e:2x2] [--models llama-3.2-1b-shape,llama-3.1-8b-shape]
                                   [--sizes 1,2,4,8,16,32,64] [--context 512] [--json OUT]

`compiled.cost_analysis()` counts a loop body once (BENCHMARKS.md), and the target's layers are a
`lax.scan`, so the totals are assembled: C1(N), the verify program (`tune.verify_program`: forward
and greedy head, the Pallas kernel in it) of the same shape with one layer, and H(N), the head alone
(final norm, LM head, argmax); one layer is C1 - H and the target is H + L x (C1 - H), in flops
and in bytes accessed. The compiler's bytes are not the traffic of a real step: they count each
op's operands and outputs, a prefetch copy of a weight into on-chip memory and layout bitcasts
included (checked: a lone bf16 [4, 2048] x [2048, 8192] matmul reports 5x its weight's bytes, the
1-row one 1x). So the time is the roofline max(flops / peak, floor bytes / HBM bandwidth), the floor
being what a step must read: every parameter once and the KV cache up to the context, at the chip's
published peaks (no overlap loss, launch or loop overhead): a lower bound on the step time, not a
measurement. The speedup it implies, tau x t_ar / t_verify(N), leaves out the drafter and the
round's overhead: an upper bound.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# Published peaks per chip (Cloud TPU system architecture pages): bf16 FLOP/s, HBM bytes/s.
CHIP_PEAKS = {"TPU v5 lite": (197e12, 819e9), "TPU v6 lite": (918e12, 1640e9), "TPU v4": (275e12, 1228e9)}


def programs(name: str, sizes, context: int, mesh):
    """{N: (one-layer verify Program, head Program)} for the shape `name`, abstract and placed on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hsd_jax import compile as hc
    from hsd_jax import tune
    from hsd_jax.models import llama

    cfg = hc.SHAPES[name].replace(dtype="bfloat16", attention_impl=hc.PLATFORM_IMPL["tpu"], num_layers=1)
    placed = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), tree)
    params = placed(hc.abstract_target(cfg, name).params)
    verify = tune.verify_program(cfg)
    head = jax.jit(lambda p, f: llama.serving_argmax(p, cfg, f, None))
    out = {}
    for n in sizes:
        inputs = placed(jax.eval_shape(lambda n=n: tune.verify_inputs(cfg, n, context)))
        features = placed(jax.ShapeDtypeStruct((1, n, cfg.hidden_size), jnp.bfloat16))
        out[n] = (hc.Program(f"{name}/verify{n}/1-layer", verify, (params, *inputs, None), {}, mesh),
                  hc.Program(f"{name}/head{n}", head, (params, features), {}, mesh, kernels_expected=False))
    return out


def estimate(layer1, head, cfg, context: int, n: int, peaks) -> dict:
    """Totals for the target's layers from the one-layer program's and the head's costs; the floor
    bytes (parameters, KV cache read and written) and the roofline time."""
    per_layer = {k: layer1[k] - head[k] for k in ("flops", "bytes_accessed")}
    total = {k: head[k] + cfg.num_layers * per_layer[k] for k in per_layer}
    import jax
    import numpy as np

    from hsd_jax import compile as hc

    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(hc.abstract_target(cfg, "floor").params))
    floor = 2 * params + 2 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * (context + n)   # bf16
    flops_s, bytes_s = peaks
    compute, memory = total["flops"] / flops_s * 1e3, floor / bytes_s * 1e3
    return {"flops": total["flops"], "compiler_bytes": total["bytes_accessed"], "floor_bytes": floor,
            "ms_estimate": round(max(compute, memory), 4), "bound": "memory" if memory >= compute else "compute"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tpu", default="v5e:2x2")
    p.add_argument("--models", default="llama-3.2-1b-shape,llama-3.1-8b-shape")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from hsd_jax import compile as hc

    hc.use_cpu_backend()
    from hsd_jax import sharding

    devices = hc.tpu_devices(a.tpu)
    kind = devices[0].device_kind
    if kind not in CHIP_PEAKS:
        print(f"error: no published peaks here for {kind!r} (known: {', '.join(CHIP_PEAKS)})", file=sys.stderr)
        return 2
    mesh = sharding.make_mesh(1, 1, devices=devices[:1])
    sizes = [int(x) for x in a.sizes.split(",")]
    report = {"topology": a.tpu, "chip": kind, "peaks": CHIP_PEAKS[kind], "context": a.context, "models": {}}
    for name in a.models.split(","):
        cfg = hc.SHAPES[name]
        rows = report["models"][name] = {}
        for n, (verify, head) in programs(name, sizes, a.context, mesh).items():
            r1, rh = hc.build(verify, "tpu"), hc.build(head, "tpu")
            if not (r1.ok and rh.ok):
                print(f"error: {name} N={n}: {r1.error or rh.error}", file=sys.stderr)
                return 1
            rows[n] = dict(estimate(r1.cost, rh.cost, cfg, a.context, n, CHIP_PEAKS[kind]), mosaic=r1.kernels.get("mosaic", 0),
                           compile_s=round(r1.seconds + rh.seconds, 1))
            print(json.dumps({"model": name, "n": n, **rows[n]}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
