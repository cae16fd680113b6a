"""The accelerator run pack: one time-boxed command that turns a lent GPU's minutes into results.

Parts, most valuable first (each runs alone, in its own process, under its own deadline):
  smoke   the engine on the device with a tiny random target: ar / hsd / eagle compile and agree;
  train   self-distilled data from the target (batched jitted generation on training prompts), then
          HSD, EAGLE-style and EAGLE-3 drafters trained by `hsd_jax.train.trainer.train` (the
          `hsd train` code path) at GPU scale, equal steps; returns the bf16 drafters with held-out
          diagnostics;
  scale   random-weight bf16 targets of Llama-3.1-8B and Llama-3.2-1B shapes: ar ms per token, verify ms
          by N, each drafter kind's round (draft, overhead), the speedup each reaches at SmolLM2's tau;
  exact   bf16 greedy identity: each method's prefix match against ar with and without
          `generate(..., exact=N)` (one row width for every target forward), its cost, and per layer
          where a token's 1-row and k-row computations part;
  bench   `hsd bench` on MT-bench, batch 1 and batch 8, every method side by side against ar;
  tune    the target's verify-cost curve (N = 1..64) and `hsd tune` on a GPU-sized tree grid;
  kernel  the Pallas tree-attention kernel against the jnp reference: errors (f32, bf16) and time
          against plain XLA attention for N = 1..64 new tokens, cache lengths 512..4096.

Everything returned lies directly under --out (at most 8 files): summary.md, results.json,
log.txt, bench.png, tuned.json, drafters.tar (hsd/, eagle/, eagle3/), data.tar (the token shards,
when they fit in 15 MiB). `--dry-run` runs every part
on the CPU with tiny sizes (the test suite does, so the pack cannot rot between leases: six parts
`--in-process`, in one process, and one through the per-part process driver).

    bash benchmarks/device/run.sh --parts train,bench,tune --out $OUT --model /tmp/hsd_stage/model.gguf \
        --prompts /tmp/hsd_stage/train_prompts.jsonl.gz --budget-s 470
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PARTS = ("smoke", "train", "scale", "exact", "bench", "tune", "kernel")
# share of the time budget per part (of the parts asked for; renormalised)
SHARE = {"smoke": 0.15, "train": 0.47, "scale": 0.3, "exact": 0.3, "bench": 0.33, "tune": 0.12, "kernel": 0.2}
MARGIN_S = 12  # a part stops starting new work this long before its hard limit


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything that scales between the GPU run and the CPU dry run."""

    smoke_dtypes: tuple = ("float32", "bfloat16")
    gen_batch: int = 512
    gen_new_tokens: int = 384       # the first lease used up all prompts at 256 (3.96M tokens)
    gen_prompt_tokens: int = 256
    gen_bucket: int = 256
    gen_share: float = 0.25          # of the train part's time (the first lease's data took 78 s)
    min_prompts: int = 0             # prompts to answer at least (0: as many as the time allows)
    max_prompts: int = 0             # prompts to answer at most (0: all staged)
    train_batch: int = 24
    train_window: int = 640
    train_unroll: int = 5
    train_ce_positions: int = 128
    train_steps: int = 6000          # schedule length; max_seconds usually ends the run first
    train_vocab: int = 16384
    train_lr: float = 6e-4
    train_overhead_s: float = 20.0   # per run: feature cache (first run), evaluation, export
    eagle_step_cost: float = 1.0     # an eagle (and eagle3) step's time over an hsd step's (equal on the CPU; the H200's
                                     # first lease measured 3.7x only because the compile was counted)
    feature_batch: int = 64
    bench_prompts: int = 80
    bench_new_tokens: int = 128
    bench_bucket: int = 512          # MT-bench chat prompts reach 402 tokens: one compile per method
    bench_tree: tuple = (24, 6, 4)   # nodes, depth, top-k
    bench_batch8_methods: str = "ar,eagle,eagle3,hsd-noreuse,hsd-refresh,hsd-chain"
    bench_batch1_methods: str = "ar,sd,eagle,eagle3,hsd-noreuse,hsd-chain,ngram,lookup,hsd+lookup,hsd+lookup/0"
    identity_prompts: int = 16
    identity_always: bool = False    # run the float32 identity check even when bf16 kept identity
    tune_sizes: tuple = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    tune_grid: tuple = ((8, 4, 3), (24, 6, 4), (48, 6, 8))
    tune_prompts: int = 4
    tune_finalists: int = 2
    tune_lookup: tuple = (0, 4)      # prompt-lookup nodes tried with each finalist
    tune_lookup_min_match: tuple = (2,)   # shortest lookup matches tried (the bench part compares 0 and 2)
    tune_new_tokens: int = 64
    kernel_n: tuple = (1, 2, 4, 8, 16, 32, 64)
    kernel_seq: tuple = (512, 1024, 2048, 4096)
    kernel_heads: tuple = (9, 3, 64)  # SmolLM2-135M: query heads, KV heads, head dim
    kernel_repeats: int = 50          # calls per timed loop (inside one jit)
    kernel_batch: int = 8
    max_cache_len: int = 1024
    scale_targets: tuple = ("llama-3.1-8b-shape", "llama-3.2-1b-shape")   # the bigger first: a cut run keeps it
    scale_context: int = 512          # cached tokens before the timed rounds
    scale_new_tokens: int = 64
    scale_verify_n: tuple = (1, 2, 4, 8, 16, 32, 64)
    scale_repeats: int = 10
    scale_kinds: tuple = ("hsd", "eagle", "eagle3")
    exact_prompts: int = 8            # MT-bench, one batch
    exact_new_tokens: int = 96
    exact_rows: int = 32              # engine.EXACT_ROWS: the bench tree's 25 slots fit
    exact_methods: str = "hsd,eagle,eagle3,sd,lookup"
    exact_diag_tokens: int = 4        # tokens recomputed both ways before the first difference


DRY = Sizes(smoke_dtypes=("float32",), gen_batch=4, gen_new_tokens=8, gen_prompt_tokens=96, gen_bucket=32, gen_share=0.5, min_prompts=8, max_prompts=24,
            train_batch=2, train_window=48, train_unroll=2, train_ce_positions=8, train_steps=3, train_vocab=256,
            feature_batch=2, bench_prompts=2, bench_new_tokens=6, bench_bucket=32, bench_tree=(3, 2, 2),
            bench_batch8_methods="ar,hsd-refresh", bench_batch1_methods="ar,eagle,eagle3",
            identity_prompts=2, identity_always=True, tune_sizes=(1, 2), tune_grid=((2, 2, 1),), tune_prompts=2, tune_finalists=1, tune_new_tokens=4, tune_lookup=(0,), tune_lookup_min_match=(2,), train_overhead_s=2.0,
            kernel_n=(1, 4), kernel_seq=(256,), kernel_repeats=2, kernel_batch=2, max_cache_len=256,
            scale_targets=("tiny-shape",), scale_context=24, scale_new_tokens=6, scale_verify_n=(1, 2), scale_repeats=2,
            exact_prompts=2, exact_new_tokens=8, exact_rows=8, exact_methods="hsd", exact_diag_tokens=3)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def load_target(args, dtype=None, max_cache_len=None, tokenizer=True):
    from hsd_jax import load_target as load

    return load(args.model, dtype=dtype, max_cache_len=max_cache_len or args.sizes.max_cache_len,
                attention_impl=args.attention_impl, tokenizer=tokenizer)


def training_prompts(args) -> list[str]:
    """The staged training prompts (GSM8K-train questions, ShareGPT first user turns), or in a
    dry run the shipped GSM8K-train sample. Never an evaluation suite."""
    if args.prompts:
        opener = gzip.open if args.prompts.endswith(".gz") else open
        with opener(args.prompts, "rt", encoding="utf-8") as f:
            return [json.loads(line)["prompt"] for line in f if line.strip()]
    from hsd_jax.train.data import gsm8k_questions

    return gsm8k_questions()


# ---------------------------------------------------------------------------------------- parts


def part_smoke(args, deadline: float) -> dict:
    """Tiny random target on the device: every method compiles and matches ar at T=0 (f32)."""
    import jax

    from hsd_jax import generate, load_drafter
    from hsd_jax.api import Target
    from hsd_jax.config import ModelConfig
    from hsd_jax.models import llama

    out = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__, "backend": jax.default_backend()}
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    for dtype in args.sizes.smoke_dtypes:   # the dry run: float32 only (bf16 on the CPU: tests/test_speculative.py)
        cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, dtype=dtype, attention_impl=args.attention_impl)
        target = Target(llama.init_params(cfg, jax.random.key(0), init_std=0.3), cfg, None, 256, "tiny")
        ar = generate(target, prompts, max_new_tokens=24)
        rows = out[dtype] = {"ar": {"compile_s": round(ar[0].stats["compile_seconds"], 2)}}
        for kind in ("hsd", "eagle"):
            d = load_drafter(kind, target=target, random_init=True)
            res = generate(target, prompts, max_new_tokens=24, method=kind, drafter=d, tree_nodes=6, tree_depth=3,
                           tree_top_k=2)
            rows[kind] = {"identical_to_ar": [r.token_ids for r in res] == [r.token_ids for r in ar],
                          "compile_s": round(res[0].stats["compile_seconds"], 2)}
            write_json(args.work / "smoke.partial.json", out)
        log(f"smoke {dtype}: {rows}")
    return out


def part_train(args, deadline: float) -> dict:
    """Self-distilled data, then HSD, EAGLE-style and EAGLE-3 drafters by the `hsd train` code path."""
    import numpy as np

    from hsd_jax.train.data import generate_data, load_shards
    from hsd_jax.train.trainer import TrainConfig, train

    s, work = args.sizes, args.work
    t0 = time.time()
    total = deadline - t0
    target = load_target(args)
    data_dir = work / "data"
    prompts = training_prompts(args)
    rng = np.random.default_rng(0)
    rng.shuffle(prompts)
    enc = [ids for ids in (target.encode(p, chat=True) for p in prompts) if len(ids) <= s.gen_prompt_tokens]
    enc = enc[: s.max_prompts or None]
    log(f"train: {len(enc)} training prompts of <= {s.gen_prompt_tokens} tokens; loaded in {time.time() - t0:.1f} s")
    gen_deadline = t0 + s.gen_share * total
    gen_t0 = time.time()
    written = 0
    first = enc[: max(s.min_prompts, s.gen_batch)]
    written += generate_data(target, first, str(data_dir), batch_size=s.gen_batch, max_new_tokens=s.gen_new_tokens,
                             max_prompt_tokens=s.gen_prompt_tokens, prompt_bucket=s.gen_bucket, progress=False)
    first_s = time.time() - gen_t0
    log(f"train: first shard {first_s:.1f} s (compile included)")
    rest = enc[len(first):]
    if rest:  # shards continue the numbering of the first call's
        written += generate_data(target, enc, str(data_dir), batch_size=s.gen_batch,
                                 max_new_tokens=s.gen_new_tokens, max_prompt_tokens=s.gen_prompt_tokens,
                                 prompt_bucket=s.gen_bucket, deadline=gen_deadline, progress=False)
    gen_s = time.time() - gen_t0
    seqs, plens = load_shards(str(data_dir))
    response = int(sum(len(q) - p for q, p in zip(seqs, plens)))
    data = {"sequences": len(seqs), "response_tokens": response, "all_tokens": int(sum(len(q) for q in seqs)),
            "seconds": round(gen_s, 1), "response_tokens_per_s": round(response / max(gen_s, 1e-9), 1),
            "batch": s.gen_batch, "max_new_tokens": s.gen_new_tokens, "prompts_available": len(enc),
            "sources": "GSM8K train questions (MIT); ShareGPT V3 first user turns (answers written by the target)"}
    log(f"train data: {data}")
    out = {"data": data, "runs": {}}
    tar = args.out / "data.tar"  # the token shards come back too (CPU training can reuse them)
    with tarfile.open(tar, "w") as tf:
        tf.add(data_dir, arcname="data")
    if tar.stat().st_size > 15 * 2**20:
        tar.unlink()
    # equal budget = equal steps: hsd runs against the clock, eagle and eagle3 then take the same
    # steps, given the time they need (s.eagle_step_cost x an hsd step each)
    kinds = ("hsd", "eagle", "eagle3")
    weight = {"hsd": 1.0, "eagle": s.eagle_step_cost, "eagle3": s.eagle_step_cost}
    steps = s.train_steps
    for i, kind in enumerate(kinds):
        left = deadline - time.time() - MARGIN_S - (len(kinds) - i) * s.train_overhead_s
        budget = left * weight[kind] / sum(weight[k] for k in kinds[i:]) + s.train_overhead_s
        if budget < 5:
            out["runs"][kind] = {"skipped": f"{left:.0f} s left"}
            continue
        cfg = TrainConfig(kind=kind, model=args.model, data_dir=str(data_dir), out_dir=str(work / f"run_{kind}"),
                          feature_cache=str(work / "features"), steps=steps, batch_size=s.train_batch,
                          window=s.train_window, unroll=s.train_unroll, ce_positions=s.train_ce_positions,
                          learning_rate=s.train_lr, warmup_steps=min(100, steps), ce_weight=1.0,
                          draft_vocab_size=s.train_vocab, save_every=10**6, eval_every=10**6,
                          feature_batch=s.feature_batch, max_seconds=round(budget, 1), eval_untrained=False)
        t = time.time()
        final = train(cfg, target=target, progress=False, log=log)
        steps = final["step"]
        _write_card(work / f"run_{kind}" / "drafter", kind, cfg, final, data, args)
        out["runs"][kind] = dict(final, seconds=round(time.time() - t, 1), config=dataclasses.asdict(cfg))
        log(f"train {kind}: {out['runs'][kind]}")
    tar = args.out / "drafters.tar"   # one file for every drafter: the device returns at most 8
    with tarfile.open(tar, "w") as tf:
        for kind in kinds:
            if (work / f"run_{kind}" / "drafter").is_dir():
                tf.add(work / f"run_{kind}" / "drafter", arcname=kind)
    out["drafters_tar_bytes"] = tar.stat().st_size
    return out


def _write_card(path: Path, kind: str, cfg, final: dict, data: dict, args) -> None:
    import jax

    dev = jax.devices()[0]
    lines = [f"# {kind} drafter for SmolLM2-135M-Instruct, trained on {getattr(dev, 'device_kind', dev)}", "",
             "Made by the accelerator run pack (`bash benchmarks/device/run.sh --parts train`), the same code path "
             "as `hsd train`.", "",
             f"- Data: {data['response_tokens']:,} self-distilled response tokens in {data['sequences']:,} sequences "
             f"({data['sources']}); no evaluation prompts.",
             f"- Training: {final['step']} steps of {cfg.batch_size} windows x {cfg.window} tokens, unroll "
             f"{cfg.unroll}, {cfg.ce_positions} CE positions per row, CE weight {cfg.ce_weight}, peak lr "
             f"{cfg.learning_rate}, draft vocabulary {cfg.draft_vocab_size}, {final.get('wall_seconds_this_run')} s.",
             f"- Held-out top-1 acceptance by depth along the target's greedy path: {final['accept_by_depth']}; "
             f"chain tau estimate {final['chain_tau_estimate']}.",
             "", "```json", json.dumps(final, indent=1), "```", ""]
    (path / "MODEL_CARD.md").write_text("\n".join(lines))


def _drafters(args, target) -> dict:
    """The drafters to benchmark: the ones trained by this run's `train` part where present, else shipped
    (random where the shipped one was built for another target)."""
    from hsd_jax import ModelLoadError, load_drafter

    out = {}
    for kind in ("hsd", "eagle", "eagle3", "sd", "ngram"):
        trained = args.work / f"run_{kind}" / "drafter"
        shipped = ROOT / "hsd_jax" / "drafters" / "smollm2-135m" / kind  # the staged GGUF is the embedded model
        path = str(trained if (trained / "drafter.json").is_file() else shipped)
        try:
            out[kind] = (load_drafter(kind, path, target=target), path)
        except ModelLoadError:   # a shipped drafter built for SmolLM2 on another target (the dry run's tiny GGUF)
            out[kind] = (load_drafter(kind, target=target, random_init=True), "random: the shipped one does not fit")
    out["lookup"] = (load_drafter("lookup", target=target), "built-in")
    return out


def _bench_tree(sizes) -> dict:
    """The benchmarked tree as generate's options (`Sizes.bench_tree`)."""
    nodes, depth, top_k = sizes.bench_tree
    return dict(tree_nodes=nodes, tree_depth=depth, tree_top_k=top_k)


def _mt_bench_setup(args, num_prompts: int) -> tuple:
    """(target, drafters, token ids of the first `num_prompts` MT-bench prompts as chat) for a part."""
    from hsd_jax.prompts import load_suite

    target = load_target(args)
    drafters = _drafters(args, target)
    return target, drafters, [target.encode(p, chat=True) for p in load_suite("mt_bench", num_prompts)]


def part_bench(args, deadline: float) -> dict:
    """MT-bench side by side, batch 8 then batch 1 (time-boxed: each covers the prompts it reached)."""
    from hsd_jax.bench import format_table, machine_info, make_runner, method_spec, plot, run_bench

    s = args.sizes
    target, drafters, ids = _mt_bench_setup(args, s.bench_prompts)
    tree = _bench_tree(s)
    out = {"tree": tree, "drafters": {k: v[1] for k, v in drafters.items()}, "machine": machine_info(),
           "dtype": target.config.dtype}
    t0 = time.time()
    plans = [(8, s.bench_batch8_methods, 0.4), (1, s.bench_batch1_methods, 1.0)]
    for batch, methods, share in plans:
        runners = {}
        for name in methods.split(","):
            kind = method_spec(name)[0]
            runners[name] = make_runner(target, name, None if kind == "ar" else drafters[kind][0], options=tree,
                                        max_new_tokens=s.bench_new_tokens, prompt_bucket=s.bench_bucket)
        stop = t0 + share * (deadline - t0) - MARGIN_S
        res = run_bench(runners, ids, batch_size=batch, progress=False, deadline=stop)
        result = {"suite": "mt_bench", "num_prompts": res["ar"]["prompts"], "batch_size": batch, "temperature": 0.0,
                  "max_new_tokens": s.bench_new_tokens, "tree": tree, "machine": out["machine"], "methods": res}
        out[f"batch{batch}"] = result
        log(f"bench batch {batch} ({res['ar']['prompts']} prompts):\n" + format_table(res))
        if batch == 1:
            plot(result, str(args.out / "bench.png"))
        elif s.identity_always or not all(m["identical_to_ar"] for m in res.values()):
            # bf16 near-ties flip tokens between verify and decode shapes: is every method lossless in f32?
            every = ",".join(dict.fromkeys(f"{s.bench_batch8_methods},{s.bench_batch1_methods}".split(",")))
            out["identity_f32"] = _identity_f32(args, ids[: s.identity_prompts], tree, every)
        write_json(args.work / "bench.partial.json", out)
    return out


def _identity_f32(args, ids, tree, methods: str) -> dict:
    """bf16 broke token identity somewhere: rerun the identity check in float32 (matmuls at full
    precision: no TF32), all prompts in one batch."""
    import jax

    with jax.default_matmul_precision("highest"):
        return _identity(args, ids, tree, methods)


def _identity(args, ids, tree, methods: str) -> dict:
    from hsd_jax import generate
    from hsd_jax.bench import method_spec
    from hsd_jax.methods import REGISTRY

    target = load_target(args, dtype="float32")
    drafters = _drafters(args, target)
    s = args.sizes
    ar = [r.token_ids for r in generate(target, ids, max_new_tokens=s.bench_new_tokens)]
    out = {"prompts": len(ids)}
    for name in (m for m in methods.split(",") if m != "ar"):
        kind, opts = method_spec(name)
        opts = dict(opts, **({"gamma": 4} if REGISTRY[kind].drafts == "chain" else tree))
        res = generate(target, ids, max_new_tokens=s.bench_new_tokens, method=kind, drafter=drafters[kind][0], **opts)
        out[name] = [r.token_ids for r in res] == ar
    log(f"identity in float32: {out}")
    return out


def part_tune(args, deadline: float) -> dict:
    """Verify-cost curve, then `hsd tune` on a GPU-sized grid with the best HSD drafter at hand."""
    from hsd_jax import tune as tune_mod
    from hsd_jax.train.data import gsm8k_questions

    s = args.sizes
    target = load_target(args)
    curve = tune_mod.verify_cost_curve(target, sizes=s.tune_sizes, repeats=10)
    out = {"verify_cost_ms": curve, "ratio_to_n1": {n: round(ms / curve[s.tune_sizes[0]], 3) for n, ms in curve.items()}}
    log(f"verify cost: {curve}")
    write_json(args.work / "tune.partial.json", out)
    drafter, path = _drafters(args, target)["hsd"]
    out["drafter"] = path
    by_len: dict[int, list] = {}
    for q in gsm8k_questions():
        ids = target.encode(q, chat=True)
        by_len.setdefault(-(-len(ids) // 64), []).append(ids)
    prompts = max(by_len.values(), key=len)[: s.tune_prompts]
    grid = [dict(tree_nodes=n, tree_depth=d, tree_top_k=k) for n, d, k in s.tune_grid]
    report = tune_mod.tune(target, drafter, prompts, grid=grid, max_new_tokens=s.tune_new_tokens, finalists=s.tune_finalists,
                           lookup_slots=s.tune_lookup, lookup_min_match=s.tune_lookup_min_match, curve=curve, tuned_dir=str(args.work / "tuned"), log=log)
    report["drafter"] = path
    write_json(args.out / "tuned.json", report)
    out["tuned"] = {k: report[k] for k in ("hardware", "tree", "reuse", "lookup_slots", "lookup_min_match", "expected_speedup", "expected_tokens_per_s",
                                           "ar_tokens_per_s", "acceptance_by_depth") if k in report}
    return out


def part_kernel(args, deadline: float) -> dict:
    """Pallas tree attention vs the jnp reference (XLA): errors in f32 and bf16; device time per call
    in bf16 at batch `kernel_batch`, measured over a loop of calls inside one jit."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tree_attention import make_case, time_ms

    from pallas_kernels.tree_attention import tree_attention_pallas, tree_attention_reference

    s = args.sizes
    hq, hkv, dh = s.kernel_heads
    kernel = jax.jit(tree_attention_pallas)
    reference = jax.jit(tree_attention_reference)
    out = {"heads": {"q": hq, "kv": hkv, "dim": dh}, "errors": [], "timing": []}
    with jax.default_matmul_precision("highest"):
        for dtype in ("float32", "bfloat16"):
            for n in sorted({s.kernel_n[-1], s.kernel_n[len(s.kernel_n) // 2]}):
                args_ = make_case(2, n, s.kernel_seq[0], hq, hkv, dh, jnp.dtype(dtype))
                try:
                    diff = float(jnp.max(jnp.abs(kernel(*args_).astype(jnp.float32)
                                                 - reference(*args_).astype(jnp.float32))))
                    out["errors"].append({"dtype": dtype, "n": n, "seq": s.kernel_seq[0], "max_abs_diff": diff})
                except Exception as e:  # noqa: BLE001  one failing case is a result, not a crash
                    out["errors"].append({"dtype": dtype, "n": n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                log(f"kernel error: {out['errors'][-1]}")
    def looped(fn):
        """`kernel_repeats` dependent calls inside one jit: device time per call, no dispatch."""
        def run(q, k, v, lengths, parents):
            body = lambda _, q: q + (fn(q, k, v, lengths, parents) * 1e-3).astype(q.dtype)
            return jax.lax.fori_loop(0, s.kernel_repeats, body, q)
        return jax.jit(run)

    first = (s.kernel_n[-1], s.kernel_n[0])  # the widest and the 1-token case first: a cut run keeps both ends
    order = [(n, seq) for n in first for seq in s.kernel_seq]
    order += [(n, seq) for n in s.kernel_n if n not in first for seq in s.kernel_seq]
    for n, seq in order:
        if time.time() > deadline - MARGIN_S:
            out["cut_by_deadline"] = True
            break
        args_ = make_case(s.kernel_batch, n, seq, hq, hkv, dh, jnp.bfloat16)
        row = {"n": n, "seq": seq, "batch": s.kernel_batch,
               "xla_ms": round(time_ms(looped(tree_attention_reference), args_, 3) / s.kernel_repeats, 5)}
        try:
            row["pallas_ms"] = round(time_ms(looped(tree_attention_pallas), args_, 3) / s.kernel_repeats, 5)
            row["xla_over_pallas"] = round(row["xla_ms"] / row["pallas_ms"], 3)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["timing"].append(row)
        write_json(args.work / "kernel.partial.json", out)
        log(f"kernel timing: {row}")
    out["timing"].sort(key=lambda r: (r["seq"], r["n"]))
    return out


# Tokens per verify round measured on SmolLM2 (the bench part's batch-1 taus replace these when this
# lease's bench part ran first): the H200 lease of 2026-11-30 at tree 24/6/4 (BENCHMARKS.md; eagle had
# 79 training steps there), eagle3 the CPU's 8/4/3 (not run on a GPU yet).
SMOLLM2_TAU = {"hsd": (1.82, "H200 2026-11-30, 24/6/4"), "eagle": (1.27, "H200 2026-11-30, 24/6/4, 79 steps"),
               "eagle3": (1.63, "CPU, 8/4/3")}


def _smollm2_tau(args) -> dict:
    """{kind: (tau, source)}: this run's bench part (batch 1) where it ran, else SMOLLM2_TAU."""
    taus = dict(SMOLLM2_TAU)
    rec = args.work / "part_bench.json"
    if rec.is_file():
        methods = (json.loads(rec.read_text()).get("result") or {}).get("batch1", {}).get("methods", {})
        for kind in taus:
            name = next((n for n in (kind, f"{kind}-noreuse") if n in methods), None)
            if name:
                taus[kind] = (methods[name]["tau"], f"this run's bench part ({name}, batch 1)")
    return taus


def _scale_config(name: str):
    """A published shape (`hsd_jax.compile.SHAPES`), or the dry run's tiny stand-in, in bf16 with no
    EOS (random weights must not stop early)."""
    from hsd_jax.compile import SHAPES
    from hsd_jax.config import ModelConfig

    cfg = SHAPES.get(name) or ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                                          num_heads=4, num_kv_heads=2, head_dim=16)
    return cfg.replace(dtype="bfloat16", eos_token_ids=())


def _round_ms(target, prompt, n_new, method="ar", drafter=None, **opts):
    """(ms per round of `method`'s decode loop (per token for ar), its stats) from a second call (the
    first compiles)."""
    from hsd_jax import generate

    for _ in range(2):
        res = generate(target, [prompt], max_new_tokens=n_new, method=method, drafter=drafter, **opts)[0]
    s = res.stats
    return s["decode_seconds"] * 1e3 / max(s["rounds"], 1), s


def part_scale(args, deadline: float) -> dict:
    """Random-weight bf16 targets of Llama-3.2-1B and Llama-3.1-8B shapes: ar ms per token, verify ms
    by N, each drafter kind's round, and the speedup each would reach at SmolLM2's tau. Random
    weights: cost, not acceptance."""
    import gc

    import jax
    import numpy as np

    from hsd_jax import load_drafter
    from hsd_jax import tune as tune_mod
    from hsd_jax.api import Target, round_up
    from hsd_jax.engine import SpecConfig
    from hsd_jax.models import llama

    s = args.sizes
    tree = _bench_tree(s)
    width = tree["tree_nodes"] + 1
    taus = _smollm2_tau(args)
    out = {"model": "speedup = tau x t_ar / t_round; t_round = t_verify(N) + t_draft + t_overhead, one round of "
                    "the method's decode loop timed whole; t_overhead = a lookup round at the same N (no drafter: a "
                    "chain of N - 1) - t_verify(N); t_draft = t_round - that lookup round",
           "tree": tree, "context": s.scale_context, "new_tokens": s.scale_new_tokens,
           "tau_smollm2": {k: {"tau": t, "source": src} for k, (t, src) in taus.items()}, "targets": {}}
    for name in s.scale_targets:
        if time.time() > deadline - MARGIN_S:
            out["cut_by_deadline"] = True
            break
        t0 = time.time()
        cfg = _scale_config(name).replace(attention_impl=args.attention_impl)
        params = llama.init_params(cfg, jax.random.key(0))     # one jitted program: created on the device
        jax.block_until_ready(params)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        slack = max([SpecConfig(method=k, **tree).cache_slack for k in s.scale_kinds]
                    + [SpecConfig(method="lookup", gamma=width - 1).cache_slack])
        target = Target(params, cfg, None, round_up(s.scale_context + s.scale_new_tokens + slack + width, 128), name)
        prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, s.scale_context).tolist()
        row = out["targets"][name] = {"params": n_params, "init_s": round(time.time() - t0, 1)}
        row["ar_ms_per_token"], _ = _round_ms(target, prompt, s.scale_new_tokens)
        write_json(args.work / "scale.partial.json", out)
        sizes = sorted(set(s.scale_verify_n) | {width})
        row["verify_ms"] = tune_mod.verify_cost_curve(target, sizes=sizes, context=s.scale_context, repeats=s.scale_repeats)
        write_json(args.work / "scale.partial.json", out)
        base, _ = _round_ms(target, prompt, s.scale_new_tokens, "lookup", gamma=width - 1)   # N rows, no drafter
        row["lookup_round_ms"] = base
        row["overhead_ms"] = base - row["verify_ms"][width]
        rounds = row["kinds"] = {}
        drafter = None
        for kind in s.scale_kinds:
            if time.time() > deadline - MARGIN_S:
                row["cut_by_deadline"] = True
                break
            drafter = load_drafter(kind, target=target, random_init=True)
            ms, st = _round_ms(target, prompt, s.scale_new_tokens, kind, drafter, **tree)
            steps = st["drafter_forwards"] / max(st["rounds"], 1)
            tau = taus.get(kind, (None, None))[0]
            rounds[kind] = {"round_ms": ms, "drafter_steps_per_round": steps, "draft_ms": ms - base,
                            "step_ms": (ms - base) / steps if steps else None,
                            "speedup_at_smollm2_tau": tau * row["ar_ms_per_token"] / ms if tau else None}
            write_json(args.work / "scale.partial.json", out)
        row["seconds"] = round(time.time() - t0, 1)
        log(f"scale {name}: {row}")
        del target, params, drafter
        gc.collect()
    return out


def _layer_diffs(target, prompt, cont, rows: int) -> dict:
    """Where a token's two computations part: `cont`'s tokens after `prompt`, (a) one per decode
    forward (1 row, or `rows` with exact), (b) all in one verify forward, their slots a chain or a
    tree (a decoy sibling before each, so the path's slots are not contiguous), padded to `rows`
    with exact (and exact's attention, `engine.EXACT_ATTENTION`). Per layer, the largest |a - b|
    over the tokens' outputs; and whether the heads agree."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hsd_jax import engine
    from hsd_jax import tree as tree_lib
    from hsd_jax.api import round_up
    from hsd_jax.cache import advance
    from hsd_jax.models import llama

    cfg = target.config.replace(feature_layers=tuple(range(target.config.num_layers)))
    params, k = target.params, len(cont)
    capacity = round_up(len(prompt) + 2 * k + max(rows, 1) + 16, 16)
    prefill = jax.jit(llama.prefill_new_cache, static_argnames=("cfg", "capacity"))
    step = jax.jit(engine.decode_forward, static_argnames=("cfg", "rows"))
    verify = jax.jit(engine.verify_tree, static_argnames=("tcfg",))
    head = jax.jit(lambda p, f: llama.serving_argmax(p, cfg, f, None))
    _, pre = prefill(params, cfg, jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32),
                     capacity=capacity)
    out = {}
    for mode, width in (("plain", 0), ("exact", rows)):
        mcfg = cfg.replace(attention_impl=engine.EXACT_ATTENTION) if width else cfg   # as `generate` runs it
        cache, a, a_tok = pre.cache, [], []
        for t in cont:
            o = step(params, mcfg, jnp.asarray([t], jnp.int32), cache, rows=max(width, 1))
            a.append(o.aux_features[:, 0, 0].astype(jnp.float32))
            a_tok.append(int(head(params, o.features)[0, 0]))
            cache = advance(o.cache, jnp.ones((1,), jnp.int32))
        a = jnp.stack(a, 1)   # [L, k, d]
        for layout in ("chain", "tree"):
            if layout == "chain":
                toks, parents, real = list(cont), list(range(-1, k - 1)), list(range(k))
            else:   # slot 0 the root; at each depth a decoy, then the path's token
                toks, parents, real = [cont[0]], [-1], [0]
                for d in range(1, k):
                    toks += [(cont[d] + 1) % cfg.vocab_size, cont[d]]
                    parents += [real[-1], real[-1]]
                    real.append(len(toks) - 1)
            tr = tree_lib.build_tree(jnp.asarray([toks], jnp.int32), jnp.asarray([parents], jnp.int32),
                                     jnp.zeros((1, len(toks)), jnp.float32), max(k - 1, 1))
            if width > tr.num_slots:
                tr = tree_lib.pad_tree(tr, width, tr.max_depth)
            o = verify(params, mcfg, pre.cache, tr)
            b = o.aux_features[:, 0, np.asarray(real)].astype(jnp.float32)
            b_tok = [int(t) for t in np.asarray(head(params, o.features))[0, real]]
            out[f"{mode}/{layout}"] = {"rows": [max(width, 1), tr.num_slots],
                                       "max_abs_diff_by_layer": [float(x) for x in jnp.max(jnp.abs(a - b), (1, 2))],
                                       "argmax_equal": a_tok == b_tok}
    return out


def part_exact(args, deadline: float) -> dict:
    """bf16 greedy identity: every method's prefix match against ar with and without `exact` (one
    row width for ar's steps and every verify), its cost in tokens/s, and where the computations
    of a token still part (`_layer_diffs`)."""
    from hsd_jax import generate
    from hsd_jax.bench import method_spec, prefix_match
    from hsd_jax.methods import REGISTRY

    s = args.sizes
    target, drafters, ids = _mt_bench_setup(args, s.exact_prompts)
    tree = _bench_tree(s)
    out = {"dtype": target.config.dtype, "rows": s.exact_rows, "prompts": len(ids), "new_tokens": s.exact_new_tokens,
           "tree": tree, "drafters": {k: v[1] for k, v in drafters.items()}, "plain": {}, "exact": {}}

    def run(method, exact):
        kind, opts = method_spec(method)
        if kind != "ar":
            opts = dict(opts, **({"gamma": 4} if REGISTRY[kind].drafts == "chain" else tree))
        res = generate(target, ids, max_new_tokens=s.exact_new_tokens, method=kind,
                       drafter=None if kind == "ar" else drafters[kind][0], exact=exact, **opts)
        secs = res[0].stats["seconds"]
        return [r.token_ids for r in res], round(sum(len(r.token_ids) for r in res) / secs, 1)

    ar = {}
    for mode, exact in (("plain", False), ("exact", s.exact_rows)):
        ar[mode], tps = run("ar", exact)
        out[mode]["ar"] = {"tokens_per_s": tps}
    out["ar_exact_equals_ar"] = prefix_match(ar["exact"], ar["plain"])
    write_json(args.work / "exact.partial.json", out)
    first_diff = None
    for method in s.exact_methods.split(","):
        for mode, exact in (("plain", False), ("exact", s.exact_rows)):
            if time.time() > deadline - MARGIN_S:
                out["cut_by_deadline"] = True
                break
            toks, tps = run(method, exact)
            out[mode][method] = {"prefix_match": prefix_match(toks, ar[mode]), "identical_to_ar": toks == ar[mode],
                                 "tokens_per_s": tps}
            if toks != ar[mode] and (first_diff is None or (mode == "exact" and first_diff[0] == "plain")):
                i = next(j for j, (a, b) in enumerate(zip(toks, ar[mode])) if a != b)
                at = next((n for n, (a, b) in enumerate(zip(toks[i], ar[mode][i])) if a != b), len(ar[mode][i]))
                first_diff = (mode, method, i, at)
            write_json(args.work / "exact.partial.json", out)
        log(f"exact {method}: plain {out['plain'].get(method)}, exact {out['exact'].get(method)}")
    # the first difference (in exact mode where there is one): the tokens before it, recomputed both ways
    mode, method, i, at = first_diff or ("none", None, 0, min(s.exact_diag_tokens, len(ar["plain"][0])))
    start = max(at - s.exact_diag_tokens, 0)
    out["first_difference"] = {"mode": mode, "method": method, "prompt": i, "token": at if first_diff else None}
    if time.time() < deadline - MARGIN_S and at > start:
        out["layer_diffs"] = _layer_diffs(target, ids[i] + ar["plain"][i][:start], ar["plain"][i][start:at], s.exact_rows)
        log(f"exact: layer diffs {out['layer_diffs']}")
    return out


PART_FUNCS = {"smoke": part_smoke, "train": part_train, "bench": part_bench, "tune": part_tune, "kernel": part_kernel,
              "scale": part_scale, "exact": part_exact}


# ---------------------------------------------------------------------------------------- driver


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def summary(results: dict, args) -> str:
    """A short markdown summary of whatever parts produced."""
    lines = [f"# Accelerator run pack ({'dry run' if args.dry_run else 'device run'})", "",
             f"Command: `bash benchmarks/device/run.sh {' '.join(args.argv)}`", ""]
    for name, r in results.items():
        status = r.get("status")
        lines.append(f"## {name}: {status}, {r.get('seconds')} s")
        res = r.get("result") or {}
        if name == "train" and res:
            lines.append(f"- data: {res['data']}")
            for kind, run in res.get("runs", {}).items():
                keys = ("step", "accept_by_depth", "bypass_accept_by_depth", "feature_error_vs_copy",
                        "chain_tau_estimate", "steps_per_s", "window_tokens_per_s", "skipped")
                lines.append(f"- {kind}: " + ", ".join(f"{k} {run[k]}" for k in keys if k in run))
        if name == "bench":
            from hsd_jax.bench import format_table

            for key in ("batch8", "batch1"):
                if key in res:
                    lines += ["", f"MT-bench, batch {res[key]['batch_size']}, {res[key]['num_prompts']} prompts, "
                                  f"tree {res['tree']}, drafters {res['drafters']}:", "",
                              format_table(res[key]["methods"])]
            if "identity_f32" in res:
                lines.append(f"- identity in float32: {res['identity_f32']}")
        if name == "tune" and res:
            lines.append(f"- verify cost ms by N: {res.get('verify_cost_ms')}")
            lines.append(f"- tuned: {res.get('tuned')}")
        if name == "kernel" and res:
            lines.append(f"- errors: {res.get('errors')}")
            for row in res.get("timing", []):
                lines.append(f"- N={row['n']} S={row['seq']}: xla {row['xla_ms']} ms, pallas "
                             f"{row.get('pallas_ms', row.get('error'))} ms")
        if name == "smoke" and res:
            lines.append(f"- {res}")
        if name == "scale" and res:
            lines += [f"- model: {res['model']}", f"- tau (SmolLM2): {res['tau_smollm2']}"]
            for target, row in res.get("targets", {}).items():
                lines.append(f"- {target} ({row['params'] / 1e9:.2f}B): ar {_ms(row.get('ar_ms_per_token'))} ms/token, "
                             f"verify ms by N {row.get('verify_ms')}, overhead {_ms(row.get('overhead_ms'))} ms")
                for kind, k in row.get("kinds", {}).items():
                    lines.append(f"  - {kind}: round {_ms(k['round_ms'])} ms, draft {_ms(k['draft_ms'])} ms "
                                 f"({k['drafter_steps_per_round']:.1f} steps of {_ms(k['step_ms'])} ms), "
                                 f"speedup at SmolLM2's tau {k['speedup_at_smollm2_tau'] or 0:.2f}x")
        if name == "exact" and res:
            lines.append(f"- {res['dtype']}, {res['prompts']} prompts x {res['new_tokens']} tokens, exact = "
                         f"{res['rows']} rows; ar exact vs ar: {res.get('ar_exact_equals_ar')}")
            for mode in ("plain", "exact"):
                lines.append(f"- {mode}: " + "; ".join(
                    f"{m} {r['tokens_per_s']} tok/s" + (f", prefix match {r['prefix_match']}" if "prefix_match" in r else "")
                    for m, r in res.get(mode, {}).items()))
            lines.append(f"- first difference: {res.get('first_difference')}")
            for key, d in res.get("layer_diffs", {}).items():
                lines.append(f"  - {key} (rows {d['rows']}): argmax equal {d['argmax_equal']}, max |diff| by layer "
                             + ", ".join(f"{x:.2g}" for x in d["max_abs_diff_by_layer"]))
        if r.get("error"):
            lines.append(f"- error: {r['error']}")
        lines.append("")
    return "\n".join(lines)


def run_part(args) -> int:
    """Child process: run one part and write its JSON."""
    deadline = float(args.deadline)
    t0 = time.time()
    try:
        result = PART_FUNCS[args.run_part](args, deadline)
        rec = {"status": "ok", "result": result}
    except Exception as e:  # noqa: BLE001  the driver records it and moves on to the next part
        import traceback

        traceback.print_exc()
        rec = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    rec["seconds"] = round(time.time() - t0, 1)
    write_json(args.work / f"part_{args.run_part}.json", rec)
    return 0 if rec["status"] == "ok" else 1


def drive(args) -> int:
    """Parent: run each asked part in its own process under its share of the budget."""
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        print(f"error: --parts must list some of {', '.join(PARTS)}, got {args.parts!r}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    end = time.time() + args.budget_s
    log_path = args.out / "log.txt"
    results = {}
    for i, part in enumerate(parts):
        left = end - time.time()
        share = SHARE[part] / sum(SHARE[p] for p in parts[i:])
        limit = max(20.0, left * share)
        cmd = [sys.executable, __file__, "--run-part", part, "--deadline", str(time.time() + limit)] + args.argv
        for stale in (args.work / f"part_{part}.json", args.work / f"{part}.partial.json"):
            stale.unlink(missing_ok=True)  # a killed part must not report an earlier run's result
        log(f"part {part}: {limit:.0f} s of {left:.0f} s left")
        t0 = time.time()
        with open(log_path, "a") as logf:
            logf.write(f"\n===== part {part} ({limit:.0f} s) =====\n")
            logf.flush()
            if args.in_process:   # the same part code and log, without the process boundary and its hard limit
                with contextlib.redirect_stdout(logf), contextlib.redirect_stderr(logf):
                    rc = run_part(argparse.Namespace(**dict(vars(args), run_part=part, deadline=time.time() + limit)))
            else:
                try:
                    proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=limit + 10)
                    rc = proc.returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
        rec_path = args.work / f"part_{part}.json"
        rec = json.loads(rec_path.read_text()) if rec_path.is_file() else {"status": f"no result (exit {rc})"}
        partial = args.work / f"{part}.partial.json"
        if rec.get("status") != "ok" and partial.is_file():
            rec["result"] = json.loads(partial.read_text())
        rec.setdefault("seconds", round(time.time() - t0, 1))
        results[part] = rec
        log(f"part {part}: {rec['status']} in {rec['seconds']} s")
        write_json(args.out / "results.json", {"argv": args.argv, "parts": results})
        (args.out / "summary.md").write_text(summary(results, args))
    sys.stdout.write((args.out / "summary.md").read_text())
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="train,scale,exact,bench,tune,kernel", help=f"comma list of {','.join(PARTS)}")
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/device_pack", help="folder for the results")
    p.add_argument("--work", default=None, help="scratch folder (data, features, runs); default /tmp/hsd_pack")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m or the staged .gguf file")
    p.add_argument("--prompts", default=None, help="training prompts (.jsonl[.gz] of {'prompt': ...}), staged")
    p.add_argument("--attention-impl", default="auto", choices=["auto", "pallas", "reference"])
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock seconds for all parts together")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks every part end to end")
    p.add_argument("--in-process", action="store_true",
                   help="run the parts in this process (no per-part process or hard time limit): a dry run's "
                        "parts then share one JAX start-up and model load")
    p.add_argument("--run-part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    raw = list(argv if argv is not None else sys.argv[1:])
    args.argv = [a for i, a in enumerate(raw) if a not in ("--run-part", "--deadline")
                 and (i == 0 or raw[i - 1] not in ("--run-part", "--deadline"))]
    args.out = Path(args.out).resolve()
    args.work = Path(args.work or ("/tmp/hsd_pack_dry" if args.dry_run else "/tmp/hsd_pack")).resolve()
    args.sizes = DRY if args.dry_run else Sizes()
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if args.prompts and not os.path.isfile(args.prompts):
        p.error(f"--prompts file not found: {args.prompts}")
    if args.model != "smollm2-135m" and not os.path.exists(args.model):
        p.error(f"--model not found: {args.model}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.run_part:
        return run_part(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
