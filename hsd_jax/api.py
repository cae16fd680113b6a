"""The stable public API: `load_target` and `generate`."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from hsd_jax.config import ConfigError, ModelConfig, SamplingConfig
from hsd_jax.loading.errors import ModelLoadError


class InputError(ValueError):
    """Bad user input to generate (empty prompt, too long for the cache, ...)."""


@dataclasses.dataclass
class Target:
    """A loaded target model: explicit params pytree, its config and tokenizer."""

    params: Any
    config: ModelConfig
    tokenizer: Any
    max_cache_len: int
    name: str

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: dict


def default_dtype() -> str:
    """f32 on CPU (no native bf16 there), bf16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_target(model: str = "smollm2-135m", *, dtype: str | None = None, max_cache_len: int = 2048,
                attention_impl: str = "auto", feature_layers: Sequence[int] = (),
                tokenizer: bool = True) -> Target:
    """Load the embedded default (`smollm2-135m`), a .gguf file or a Hugging Face directory."""
    from hsd_jax.loading.gguf_loader import DEFAULT_MODEL, default_gguf_path, load_gguf
    from hsd_jax.loading.hf import load_hf_dir
    from hsd_jax.loading.tokenizer import load_tokenizer

    if int(max_cache_len) <= 0:
        raise ConfigError(f"max_cache_len must be positive, got {max_cache_len}")
    overrides = dict(dtype=dtype or default_dtype(), attention_impl=attention_impl,
                     feature_layers=tuple(feature_layers))
    if model == DEFAULT_MODEL:
        path = default_gguf_path()
    elif os.path.exists(model):
        path = model
    else:
        raise ModelLoadError(f"unknown model {model!r}: give {DEFAULT_MODEL!r}, a .gguf file "
                             "or a Hugging Face model directory")
    loader = load_gguf if path.endswith(".gguf") else load_hf_dir
    try:
        cfg, params = loader(path, **overrides)
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    tok = load_tokenizer(path) if tokenizer else None
    if tok is not None and tok.eos_token_id is not None and tok.eos_token_id not in cfg.eos_token_ids:
        cfg = cfg.replace(eos_token_ids=cfg.eos_token_ids + (int(tok.eos_token_id),))
    return Target(params, cfg, tok, int(max_cache_len), model)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def encode_prompts(target: Target, prompts, chat: bool) -> list[list[int]]:
    """Token ids per prompt; prompts are strings or lists of token ids."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise InputError("no prompts given")
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise InputError(f"prompt {i} is empty")
            if target.tokenizer is None:
                raise InputError("this target has no tokenizer: pass token ids")
            p = target.encode(p, chat)
        p = [int(t) for t in p]
        if not p:
            raise InputError(f"prompt {i} is empty")
        if max(p) >= target.config.vocab_size or min(p) < 0:
            raise InputError(f"prompt {i} has token ids outside [0, {target.config.vocab_size})")
        ids.append(p)
    return ids


def pad_prompts(ids: list[list[int]], multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to a bucketed length (limits recompiles); returns tokens [B, T] and lengths [B]."""
    t = round_up(max(len(p) for p in ids), multiple)
    tokens = np.zeros((len(ids), t), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    return tokens, np.asarray([len(p) for p in ids], np.int32)


_COMPILED: dict = {}


def compiled(fn, args, static: dict):
    """AOT-compile `fn` for these argument shapes once; returns (executable, compile seconds now)."""
    shapes = jax.tree.map(lambda a: (np.shape(a), str(getattr(a, "dtype", type(a)))), args)
    key = (fn, str(jax.tree.structure(args)), str(shapes), tuple(sorted(static.items())))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    exe = fn.lower(*args, **static).compile()
    _COMPILED[key] = exe
    return exe, time.perf_counter() - t0


def generate(target: Target, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = False, method: str = "ar",
             drafter=None, **options) -> list[GenerationResult]:
    """Generate a continuation per prompt with one jitted decode loop; one result per prompt."""
    from hsd_jax import engine

    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = SamplingConfig(float(temperature), int(top_k), float(top_p))
    if method != "ar":
        raise InputError(f"unknown method {method!r}; available: ar")
    if options:
        raise InputError(f"unknown options for method {method!r}: {', '.join(sorted(options))}")
    ids = encode_prompts(target, prompts, chat)
    longest = max(len(p) for p in ids)
    if longest + max_new_tokens > target.max_cache_len:
        raise InputError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the "
                         f"cache capacity max_cache_len={target.max_cache_len}")
    tokens, lengths = pad_prompts(ids)
    capacity = min(round_up(tokens.shape[1] + max_new_tokens, 128), round_up(target.max_cache_len, 16))
    args = (target.params, tokens, lengths, jax.random.key(seed))
    static = dict(cfg=target.config, sampling=sampling, max_new_tokens=int(max_new_tokens), capacity=capacity)
    run, compile_s = compiled(engine.ar_generate, args, static)
    t0 = time.perf_counter()
    out = jax.device_get(run(*args))
    elapsed = time.perf_counter() - t0
    results = []
    for i in range(len(ids)):
        n = int(out.num_tokens[i])
        new = [int(t) for t in out.tokens[i, :n]]
        forwards = int(out.target_forwards[i])
        stats = {"method": method, "new_tokens": n, "prompt_tokens": len(ids[i]), "target_forwards": forwards,
                 "tau": n / max(forwards, 1), "drafter_forwards": 0, "accepted_hist": [forwards],
                 "seconds": elapsed, "compile_seconds": compile_s, "tokens_per_s": n / elapsed if elapsed > 0 else 0.0}
        text = target.decode(new) if target.tokenizer is not None else ""
        results.append(GenerationResult(new, text, stats))
    return results
