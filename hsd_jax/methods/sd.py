"""Standard speculative decoding (Leviathan et al. 2023): a small draft LM samples a chain of
gamma tokens from its own distribution q; acceptance min(1, p/q) keeps sampling lossless."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hsd_jax.cache import KVCache, advance, at_offset
from hsd_jax.config import ConfigError, ModelConfig, from_json
from hsd_jax.methods.base import Draft, DrafterKind, Method
from hsd_jax.models import llama
from hsd_jax.sampling import argmax, sample_from_probs, target_probs
from hsd_jax.tree import chain_tree


class State(NamedTuple):
    cache: KVCache   # the draft LM's KV cache over the committed tokens


def _one_token(dparams, dcfg, cache: KVCache, tokens, offset):
    """The draft LM on one token per sequence [B] at slot length + offset (scratch)."""
    b = tokens.shape[0]
    view = at_offset(cache, offset)
    out = llama.forward(dparams, dcfg, tokens[:, None], view.lengths[:, None], view, jnp.full((b, 1), -1, jnp.int32))
    return out.features[:, 0], out.cache.replace(lengths=cache.lengths)


def sample_chain(dparams, dcfg: ModelConfig, cache: KVCache, root_tokens, key, gamma: int, sampling):
    """The draft LM samples (greedy at T = 0) a chain of gamma tokens.
    Returns (tokens [B, G], q [B, G, V], cache with the chain's entries as scratch)."""
    toks, qs, last = [], [], root_tokens
    for i in range(gamma):
        f, cache = _one_token(dparams, dcfg, cache, last, i)
        logits = llama.serving_logits(dparams, dcfg, f)
        key, sub = jax.random.split(key)
        q = target_probs(logits, sampling)
        last = argmax(logits) if sampling.greedy else sample_from_probs(q, sub)
        toks.append(last), qs.append(q)
    return jnp.stack(toks, 1), jnp.stack(qs, 1), cache


def init(rnd, prefill_out, root) -> State:
    _, out = llama.prefill_new_cache(rnd.dparams, rnd.dcfg, rnd.prompt_tokens, rnd.prompt_lens, rnd.capacity)
    return State(out.cache)


def draft(rnd, state: State, root, history, key) -> Draft:
    toks, q, cache = sample_chain(rnd.dparams, rnd.dcfg, state.cache, root, key, rnd.spec.gamma, rnd.sampling)
    return Draft(chain_tree(toks, root), State(cache), jnp.full((rnd.batch,), rnd.spec.gamma, jnp.int32),
                 chain=(toks, q))


def update(rnd, state: State, drft: Draft, acc, vout, live):
    """Commit the draft LM's entries for x_p, d_1..d_m; feed d_G first when the whole chain passed."""
    g = rnd.spec.gamma
    m = acc.num_accepted
    full = live & (m == g)
    cache = jax.lax.cond(jnp.any(full), lambda c: _one_token(rnd.dparams, rnd.dcfg, c, drft.chain[0][:, -1], g)[1],
                         lambda c: c, state.cache)
    return State(advance(cache, jnp.where(live, m + 1, 0))), full.astype(jnp.int32)


def _config(raw: dict) -> ModelConfig:
    return from_json(ModelConfig, raw)


def _random(target, seed: int, **overrides):
    tcfg = target.config
    defaults = dict(vocab_size=tcfg.vocab_size, hidden_size=max(tcfg.hidden_size // 2, 16),
                    intermediate_size=max(tcfg.intermediate_size // 2, 32), num_layers=2,
                    num_heads=max(tcfg.num_kv_heads, 1), num_kv_heads=max(tcfg.num_kv_heads, 1),
                    tie_word_embeddings=True, rope_theta=tcfg.rope_theta, dtype=tcfg.dtype,
                    eos_token_ids=tcfg.eos_token_ids)
    cfg = ModelConfig(**dict(defaults, **overrides))
    return llama.init_params(cfg, jax.random.key(seed)), cfg, None


def _finish(params, cfg: ModelConfig, d2t, target):
    """The draft LM computes in the target's dtype and shares the target's embeddings (and head)
    when it was saved without them."""
    tcfg = target.config
    if cfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"draft LM vocab {cfg.vocab_size} does not match the target's {tcfg.vocab_size}")
    needed = ("embed_tokens",) if cfg.tie_word_embeddings else ("embed_tokens", "lm_head")
    params = dict({k: target.params[k] for k in needed if k not in params}, **params)
    return params, cfg.replace(dtype=tcfg.dtype), None


METHOD = Method("sd", "standard speculative decoding: a small draft LM samples a chain of gamma tokens",
                init, draft, update, DrafterKind(_config, _random, _finish, has_draft_vocab=False), drafts="chain")
