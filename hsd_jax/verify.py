"""Acceptance of a verified draft tree: greedy, and lossless stochastic rules.

All return `Accepted(num_accepted [B], path [B, D+1], token [B])`: the accepted slots from
the root (path[:, 0] = 0, padded -1) and the bonus or correction token that follows them.

- Greedy: follow the child whose token is the target's argmax (`tree.greedy_walk`).
- Trees drafted deterministically (top-k; EAGLE-2/3, HSD): at the current node try the
  children in order; accept child c with probability p(c) / sum(p); on rejection set
  p(c) = 0 and try the next sibling; if none is accepted sample from the residual p.
  With q = 1 for each proposed child this is SpecInfer's multi-draft rule and leaves
  the target distribution exactly unchanged.
- Chains sampled from a draft distribution q (standard SD): Leviathan et al.'s rule,
  accept d with probability min(1, p(d) / q(d)), else sample norm(max(0, p - q)).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hsd_jax.sampling import argmax, sample_from_probs, target_probs
from hsd_jax.tree import Tree, greedy_walk


class Accepted(NamedTuple):
    num_accepted: jax.Array
    path: jax.Array
    token: jax.Array


def accept_greedy(tree: Tree, target_tokens: jax.Array) -> Accepted:
    """target_tokens [B, T]: the target's argmax after every tree slot."""
    m, path, last = greedy_walk(tree, target_tokens)
    return Accepted(m, path, jnp.take_along_axis(target_tokens, last[:, None], -1)[:, 0])


def _accept_tree_one(tokens, first_child, next_sibling, probs, key, max_depth):
    """One sequence: sibling-by-sibling rejection down the tree. probs [T, V] target distributions."""

    def cond(s):
        return ~s[-1]

    def body(s):
        cur, child, p, m, path, key, _ = s
        key, k_u = jax.random.split(key)
        has_child = child >= 0
        c = jnp.maximum(child, 0)
        t = tokens[c]
        accept = has_child & (jax.random.uniform(k_u) * jnp.sum(p) < p[t])
        m_new = jnp.where(accept, m + 1, m)
        path = jnp.where(accept, path.at[m_new].set(c), path)
        p = jnp.where(accept, probs[c], jnp.where(has_child, p.at[t].set(0.0), p))
        cur = jnp.where(accept, c, cur)
        child = jnp.where(accept, first_child[c], jnp.where(has_child, next_sibling[c], child))
        return cur, child, p, m_new, path, key, ~has_child

    path = jnp.full((max_depth + 1,), -1, jnp.int32).at[0].set(0)
    init = (jnp.int32(0), first_child[0], probs[0], jnp.int32(0), path, key, jnp.bool_(False))
    _, _, p, m, path, key, _ = jax.lax.while_loop(cond, body, init)
    return m, path, sample_from_probs(p, key)


def accept_tree_stochastic(tree: Tree, target_probs: jax.Array, key: jax.Array) -> Accepted:
    """Lossless acceptance for deterministically drafted trees. target_probs [B, T, V]."""
    keys = jax.random.split(key, tree.tokens.shape[0])
    fn = jax.vmap(lambda *a: _accept_tree_one(*a, tree.max_depth))
    m, path, tok = fn(tree.tokens, tree.first_child, tree.next_sibling, target_probs, keys)
    return Accepted(m, path, tok)


def accept_chain_stochastic(draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                            key: jax.Array) -> Accepted:
    """Leviathan et al. on a chain. draft_tokens [B, G]; draft_probs q [B, G, V];
    target_probs p [B, G+1, V] (after the root and after each draft token)."""
    b, g = draft_tokens.shape
    k_u, k_res = jax.random.split(key)
    p_d = jnp.take_along_axis(target_probs[:, :g], draft_tokens[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    u = jax.random.uniform(k_u, (b, g))
    ok = u * q_d < p_d
    m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    idx = jnp.arange(b)
    p_m = target_probs[idx, m]
    q_m = jnp.where((m < g)[:, None], draft_probs[idx, jnp.minimum(m, g - 1)], 0.0)
    residual = jnp.maximum(p_m - q_m, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_m)
    token = sample_from_probs(residual, k_res)
    steps = jnp.arange(g + 1)[None, :]
    path = jnp.where(steps <= m[:, None], steps, -1).astype(jnp.int32)
    return Accepted(m.astype(jnp.int32), path, token)


def accept(tree: Tree, logits: jax.Array, key: jax.Array, sampling, chain=None) -> Accepted:
    """Greedy (T = 0) or lossless stochastic acceptance of a verified tree; `chain` =
    (tokens [B, G], q [B, G, V]) for a chain sampled from a draft distribution (SD)."""
    if sampling.greedy:
        return accept_greedy(tree, argmax(logits))
    p = target_probs(logits, sampling)
    if chain is not None:
        return accept_chain_stochastic(chain[0], chain[1], p, key)
    return accept_tree_stochastic(tree, p, key)


def emitted_tokens(tree: Tree, acc: Accepted) -> jax.Array:
    """Tokens a round commits [B, D+1]: the accepted draft tokens, then the bonus/correction."""
    d = acc.path.shape[1] - 1
    drafted = jnp.take_along_axis(tree.tokens, jnp.maximum(acc.path[:, 1:], 0), axis=1)
    i = jnp.arange(d + 1)[None, :]
    drafted = jnp.concatenate([drafted, jnp.zeros_like(drafted[:, :1])], 1)
    return jnp.where(i == acc.num_accepted[:, None], acc.token[:, None], drafted)
