"""`hsd` command line. Bad input prints one `error:` line on stderr and exits with status 2."""
from __future__ import annotations

import argparse
import json
import os
import sys


class UsageError(ValueError):
    """Invalid command-line input, reported as one line."""


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text with the target (and a drafter)")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a .gguf file or a HF directory")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cache-len", type=int, default=2048)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--attention-impl", choices=["auto", "pallas", "reference"], default="auto")
    p.add_argument("--method", default="ar", help="decoding method")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(func=cmd_generate)


def _check_generate_args(a):
    if not a.prompt.strip():
        raise UsageError("--prompt is empty")
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {a.temperature}")
    if a.max_cache_len < 1:
        raise UsageError(f"--max-cache-len must be >= 1, got {a.max_cache_len}")
    if a.model != "smollm2-135m" and not os.path.exists(a.model):
        raise UsageError(f"unknown model {a.model!r}: use smollm2-135m, a .gguf file or a model directory")


def cmd_generate(a) -> int:
    _check_generate_args(a)
    from hsd_jax.api import generate, load_target

    target = load_target(a.model, dtype=a.dtype, max_cache_len=a.max_cache_len,
                         attention_impl=a.attention_impl)
    res = generate(target, [a.prompt], max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                   top_k=a.top_k, top_p=a.top_p, seed=a.seed, chat=a.chat, method=a.method)[0]
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsd", description="Hidden-State Speculative Decoding in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    return parser


def main(argv=None) -> int:
    from hsd_jax.api import InputError
    from hsd_jax.config import ConfigError
    from hsd_jax.loading.errors import ModelLoadError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, InputError, ConfigError, ModelLoadError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
