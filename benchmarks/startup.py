"""Wall time per call as a user sees it, beside the decoding time, for prompts of many lengths.

One process: SmolLM2 loaded once, one warm-up call per method on another prompt, then 8 held-out
MT-bench prompts (chat template) of different lengths, each generated once per method, methods
interleaved per prompt. Prints per call: prompt tokens, wall seconds, prefill + decode seconds,
their ratio, compile seconds, and the number of decode-loop compilations per method (XLA's
backend-compile events). `--cli` instead times two `hsd generate` processes back to back (the
second finds the first's compiled programs and weights in the user cache; `--fresh-cache`: a new,
empty one, so the first process is a first run on a new machine).

    python benchmarks/startup.py [--methods ar,hsd] [--max-new-tokens 64] [--warmup]
    python benchmarks/startup.py --cli [--method hsd] [--fresh-cache]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def in_process(methods: list[str], max_new_tokens: int, warmup: bool) -> dict:
    from jax._src import monitoring

    from hsd_jax import api
    from hsd_jax.prompts import load_suite

    names = []
    monitoring.register_event_duration_secs_listener(
        lambda e, d, **kw: names.append(str(kw.get("fun_name"))) if e.endswith("backend_compile_duration") else None)
    t0 = time.perf_counter()
    target = api.load_target("smollm2-135m")
    load_s = time.perf_counter() - t0
    prompts = [p for p in load_suite("mt_bench") if 33 <= len(target.encode(p, chat=True)) <= 185]
    warm, held_out = prompts[0], prompts[1:][::max(1, len(prompts[1:]) // 8)][:8]
    drafters = {m: api.load_drafter(m, target=target) for m in methods if m != "ar"}
    warmup_s = {}
    for m in methods:
        t0 = time.perf_counter()
        if warmup:
            api.warmup(target, method=m, drafter=drafters.get(m), max_prompt_len=256, progress=False)
        api.generate(target, warm, chat=True, max_new_tokens=max_new_tokens, method=m, drafter=drafters.get(m))
        warmup_s[m] = round(time.perf_counter() - t0, 2)
    rows = []
    for p in held_out:
        for m in methods:
            t0 = time.perf_counter()
            r = api.generate(target, p, chat=True, max_new_tokens=max_new_tokens, method=m, drafter=drafters.get(m))[0]
            wall = time.perf_counter() - t0
            s = r.stats
            rows.append({"method": m, "prompt_tokens": s["prompt_tokens"], "wall_s": round(wall, 3),
                         "prefill_s": round(s["prefill_seconds"], 3), "decode_s": round(s["decode_seconds"], 3),
                         "wall_over_run": round(wall / (s["prefill_seconds"] + s["decode_seconds"]), 3),
                         "wall_over_decode": round(wall / s["decode_seconds"], 3),
                         "compile_s": round(s["compile_seconds"], 2), "new_tokens": s["new_tokens"]})
            print(json.dumps(rows[-1]), flush=True)
    return {"load_s": round(load_s, 2), "warmup_s": warmup_s, "calls": rows,
            "decode_loop_compiles": {n: names.count(n) for n in ("jit(ar_decode)", "jit(spec_decode)")},
            "prefill_compiles": {n: names.count(n) for n in ("jit(ar_prefill)", "jit(spec_prefill)")}}


def two_processes(method: str, max_new_tokens: int, fresh_cache: bool) -> dict:
    env = dict(os.environ)
    if fresh_cache:   # the first process finds nothing: it builds the kernels, caches the weights, compiles
        env["HSD_JAX_CACHE"] = tempfile.mkdtemp(prefix="hsd-startup-")
    out = {}
    for i, prompt in enumerate(("Give me three tips for learning a new language.",
                                "Write a short poem about the sea.")):
        cmd = [sys.executable, "-m", "hsd_jax", "generate", "--model", "smollm2-135m", "--method", method, "--chat",
               "--prompt", prompt, "--max-new-tokens", str(max_new_tokens), "--verbose"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        out[f"process_{i + 1}"] = {"wall_s": round(time.perf_counter() - t0, 2), "returncode": proc.returncode,
                                   "verbose": [ln for ln in proc.stderr.splitlines() if ln.startswith("[")]}
        print(json.dumps(out[f"process_{i + 1}"]), flush=True)
    if fresh_cache:
        shutil.rmtree(env["HSD_JAX_CACHE"], ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ar,hsd")
    ap.add_argument("--method", default="hsd")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--warmup", action="store_true", help="api.warmup each method (prompt buckets up to 256) first")
    ap.add_argument("--cli", action="store_true")
    ap.add_argument("--fresh-cache", action="store_true", help="--cli: both processes on a new, empty user cache")
    a = ap.parse_args()
    if a.cli:
        res = two_processes(a.method, a.max_new_tokens, a.fresh_cache)
    else:
        res = in_process([m.strip() for m in a.methods.split(",")], a.max_new_tokens, a.warmup)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
