"""Decode loops compiled as one `jax.jit` each: prefill, then `lax.while_loop` over steps.

Prompts arrive right-padded with their true lengths; the KV cache keeps a length per
sequence, so a batch of unequal prompts needs no left padding and no per-token Python.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hsd_jax.cache import KVCache, advance, init_cache
from hsd_jax.config import ModelConfig, SamplingConfig
from hsd_jax.models import llama
from hsd_jax.models.layers import jnp_dtype
from hsd_jax.sampling import sample


class DecodeOutput(NamedTuple):
    tokens: jax.Array          # [B, max_new_tokens] new token ids, -1 after the end
    num_tokens: jax.Array      # [B] tokens generated (EOS included)
    target_forwards: jax.Array  # [B] target forward passes that produced this sequence's tokens


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(eos_ids, jnp.int32), axis=-1)


def prefill(params, cfg: ModelConfig, tokens, prompt_lens, cache: KVCache):
    """Run right-padded prompts [B, T] through the target from an empty cache.

    Returns (logits at each prompt's last token [B, V], ForwardOutput with the cache
    committed to the prompt lengths).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = llama.forward(params, cfg, tokens, positions, cache)
    last = out.features[jnp.arange(b), prompt_lens - 1]
    logits = llama.logits_from_features(params, cfg, last)
    return logits, out._replace(cache=out.cache.replace(lengths=prompt_lens.astype(jnp.int32)))


def decode_step(params, cfg: ModelConfig, tokens, cache: KVCache):
    """Feed one token per sequence [B] at position lengths[b]; returns (logits [B, V], features, cache)."""
    b = tokens.shape[0]
    parents = jnp.full((b, 1), -1, jnp.int32)
    out = llama.forward(params, cfg, tokens[:, None], cache.lengths[:, None], cache, parents)
    logits = llama.logits_from_features(params, cfg, out.features[:, 0])
    return logits, out.features[:, 0], advance(out.cache, jnp.ones((b,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "max_new_tokens", "capacity"))
def ar_generate(params, prompt_tokens, prompt_lens, key, *, cfg: ModelConfig, sampling: SamplingConfig,
                max_new_tokens: int, capacity: int) -> DecodeOutput:
    """Plain autoregressive decoding with a KV cache: the baseline every method must match."""
    b = prompt_tokens.shape[0]
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, capacity, cfg.head_dim, jnp_dtype(cfg))
    logits, out = prefill(params, cfg, prompt_tokens, prompt_lens, cache)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    tokens = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((b,), jnp.int32)
    done = is_eos(first, cfg.eos_token_ids) | (max_new_tokens <= 1)

    def cond(state):
        return jnp.any(~state[4])

    def body(state):
        cache, last, tokens, count, done, key = state
        logits, _, cache = decode_step(params, cfg, last, cache)
        key, sub = jax.random.split(key)
        new = sample(logits, sub, sampling)
        live = ~done
        tokens = tokens.at[jnp.arange(b), jnp.where(live, count, max_new_tokens)].set(new, mode="drop")
        count = count + live.astype(jnp.int32)
        done = done | (live & is_eos(new, cfg.eos_token_ids)) | (count >= max_new_tokens)
        return cache, new, tokens, count, done, key

    state = jax.lax.while_loop(cond, body, (out.cache, first, tokens, count, done, key))
    return DecodeOutput(state[2], state[3], state[3])
