"""HSD: a token-free chain over the target's hidden states, tokens injected late at read-out.

The chain g_p .. g_{p+D-1} is advanced by the drafter layer alone (no token input), so one
chain serves the whole tree: depth j+1 reads g_{p+j} with each frontier token injected. After
verification the true features of the accepted path are ingested, and the chain is rebuilt
(`reuse` none) or its still-valid tail kept (`chain`, `refresh`: HSD.md's reuse).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hsd_jax.cache import KVCache, advance, at_offset, init_cache, restore_at, restore_slots, take_slots
from hsd_jax.methods.base import Draft, Method
from hsd_jax.methods.features import feature_drafter
from hsd_jax.models import drafter
from hsd_jax.tree import Tree, grow_tree, topk_draft

# `refresh` re-anchors the first two draft depths on the ingested true features and reuses only the
# deeper stale states: re-anchoring depth 1 alone lost 5.2% tau against `none` at batch 1 (8/4/3,
# MT-bench), depths 1-2 lose 0.1% for 12% fewer drafter steps (BENCHMARKS.md, reuse at batch 1).
REFRESH_DEPTHS = 2


class State(NamedTuple):
    cache: KVCache      # the drafter layer's KV cache over the committed positions
    chain: jax.Array    # [B, D, d] g_p .. g_{p+D-1}: chain states for the next round's depths


def chain_extend(dparams, dcfg, cache: KVCache, chain, start, fresh=None, every: bool = False):
    """Fill chain[:, i+1] for i >= start[b] (and for i < fresh[b] when given) by feeding chain[:, i]
    at slot length + i.

    The chain is token-free, so this never waits for drafted tokens. Steps no sequence
    needs are skipped (lax.cond), so reuse saves real work; `every` (static): some sequence needs
    every step (no reuse), so no `lax.cond`, whose operands XLA copies (the drafter's whole cache,
    a cost that grows with the capacity). A step run for other sequences leaves a sequence that
    does not need it as it was (chain and cache), so a row drafts the same in any batch. Entries
    written past the committed length are scratch; with `every` nothing is kept there (a row that
    needs no step is finished), so its slot is not put back: restoring it made XLA copy the whole
    cache before and after each step. Returns (chain, cache, steps [B]).
    """
    b, depth, _ = chain.shape
    steps = jnp.zeros((b,), jnp.int32)
    root_parent = jnp.full((b, 1), -1, jnp.int32)
    for i in range(depth - 1):
        need = (start <= i) if fresh is None else (start <= i) | (i < fresh)

        def step(carry, i=i, need=need):
            chain, cache = carry
            slot = (cache.lengths + i)[:, None]
            view = at_offset(cache, i)
            g, view = drafter.run_layers(dparams, dcfg, chain[:, i][:, None], view.lengths[:, None], view,
                                         root_parent)
            chain = chain.at[:, i + 1].set(jnp.where(need[:, None], g[:, 0], chain[:, i + 1]))
            if every:   # nothing is kept past the committed length: the step wrote only scratch
                return chain, view.replace(lengths=cache.lengths)
            return chain, restore_at(view.replace(lengths=cache.lengths), cache, slot, ~need[:, None])

        chain, cache = step((chain, cache)) if every else jax.lax.cond(jnp.any(need), step, lambda c: c, (chain, cache))
        steps = steps + need.astype(jnp.int32)
    return chain, cache, steps


def tree_from_chain(dparams, dcfg, view, chain, root_tokens, spec, root_context=None) -> Tree:
    """Grow a dynamic tree from the stored chain g_p..g_{p+D-1}: depth j+1 reads g_{p+j} with
    each frontier token injected; one batched read-out per depth. A read-out that sees earlier
    path tokens (`readout_context` > 1) gets them from `root_context` [B, context-1] and the tree."""
    k = spec.tree_top_k

    def children(j, ftok, fctx):
        g = jnp.broadcast_to(chain[:, j][:, None], ftok.shape + chain.shape[-1:])
        return topk_draft(drafter.readout(dparams, dcfg, view, g, ftok, fctx), view.d2t, k)

    first = topk_draft(drafter.readout(dparams, dcfg, view, chain[:, 0], root_tokens, root_context), view.d2t, k)
    return grow_tree(first, children, root_tokens, spec, root_context)


def recent_tokens(prompt_tokens, prompt_lens, tokens, count, n: int):
    """[B, n] the committed tokens before the newest one (tokens[count - 1]), most recent first,
    reaching back into the prompt (its first token repeats past the start, as in training)."""
    back = count[:, None] - 2 - jnp.arange(n)[None, :]          # index into the generated tokens
    gen = jnp.take_along_axis(tokens, jnp.maximum(back, 0), 1)
    ppos = jnp.maximum(prompt_lens[:, None] + back, 0)           # else into the prompt
    prompt = jnp.take_along_axis(prompt_tokens, ppos, 1)
    return jnp.where(back >= 0, gen, prompt)


def ingest(dparams, dcfg, cache: KVCache, feats, aux, count):
    """Feed true target features [B, M, d] at slots length..length+M-1; commit `count` of them.
    Returns (drafter outputs [B, M, d], cache)."""
    m = feats.shape[1]
    z = drafter.input_features(dparams, dcfg, feats, aux)
    pos = cache.lengths[:, None] + jnp.arange(m, dtype=jnp.int32)[None]
    g, cache = drafter.run_layers(dparams, dcfg, z, pos, cache)
    return g, advance(cache, count)


def rebuild_chain(dparams, dcfg, cache: KVCache, chain, acc, feats, aux, live, reuse: str):
    """After verification: ingest the true features f_p..f_{p+m}, then rebuild the chain.

    none: g_{p'} from the ingest, then D-1 chain steps. chain: keep the stale g's for positions
    after p+m (they never saw a token) and extend by the m+1 consumed. refresh: as chain, but the
    first REFRESH_DEPTHS states are fresh (g_{p'} from the ingest, then one chain step from it) and
    only the deeper ones stale. Returns (cache, chain, steps).
    """
    b, depth = chain.shape[:2]
    m = acc.num_accepted
    count = jnp.where(live, m + 1, 0)
    fp = take_slots(feats, acc.path)
    ap = jnp.stack([take_slots(a, acc.path) for a in aux]) if aux.shape[0] else aux
    g_all, new_cache = ingest(dparams, dcfg, cache, fp, ap, count)
    fresh = take_slots(g_all, m[:, None])[:, 0]
    if reuse == "none":
        kept = jnp.zeros((b,), bool)
        cache = new_cache
    else:   # the kept chain states' keys and values sit past the accepted path: the ingest's scratch must not clobber them
        cache = restore_slots(new_cache, cache, new_cache.lengths, cache.lengths + fp.shape[1])
        kept = m <= depth - 2
        shifted = take_slots(chain, jnp.minimum(jnp.arange(depth)[None] + m[:, None] + 1, depth - 1))
        chain = jnp.where(kept[:, None, None], shifted, chain)
    start = jnp.where(kept, depth - 2 - m, 0)
    first = fresh if reuse != "chain" else jnp.where(kept[:, None], chain[:, 0], fresh)
    chain = chain.at[:, 0].set(first)
    fresh_steps = jnp.where(live & kept, REFRESH_DEPTHS - 1, 0) if reuse == "refresh" else None
    chain, cache, steps = chain_extend(dparams, dcfg, cache, chain, jnp.where(live, start, depth), fresh_steps,
                                       every=reuse == "none")
    return cache, chain, steps + live.astype(jnp.int32)


def init(rnd, prefill_out, root) -> State:
    """Run the drafter over the prompt's true features and build the first chain."""
    b, t = rnd.prompt_tokens.shape
    lcfg = rnd.dcfg.layer_config()
    cache = init_cache(lcfg.num_layers, b, lcfg.num_kv_heads, rnd.capacity, lcfg.head_dim, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    z = drafter.input_features(rnd.dparams, rnd.dcfg, prefill_out.features, prefill_out.aux_features)
    g, cache = drafter.run_layers(rnd.dparams, rnd.dcfg, z, pos, cache)
    lens = rnd.prompt_lens.astype(jnp.int32)
    chain = jnp.zeros((b, rnd.spec.depth, rnd.tcfg.hidden_size), jnp.float32)
    chain = chain.at[:, 0].set(take_slots(g, (lens - 1)[:, None])[:, 0])
    chain, cache, _ = chain_extend(rnd.dparams, rnd.dcfg, cache.replace(lengths=lens), chain,
                                   jnp.zeros((b,), jnp.int32), every=True)
    return State(cache, chain)


def draft(rnd, state: State, root, history, key) -> Draft:
    context = None
    if rnd.dcfg.readout_context > 1:
        context = recent_tokens(rnd.prompt_tokens, rnd.prompt_lens.astype(jnp.int32), history.tokens,
                                history.count, rnd.dcfg.readout_context - 1)
    tree = tree_from_chain(rnd.dparams, rnd.dcfg, rnd.view, state.chain, root, rnd.spec, context)
    return Draft(tree, state, jnp.zeros((rnd.batch,), jnp.int32))


def update(rnd, state: State, drft: Draft, acc, vout, live):
    cache, chain, steps = rebuild_chain(rnd.dparams, rnd.dcfg, state.cache, state.chain, acc, vout.features,
                                        vout.aux_features, live, rnd.spec.reuse)
    return State(cache, chain), steps


METHOD = Method("hsd", "hidden-state drafter: token-free chain, late token injection, reuse",
                init, draft, update, feature_drafter("hsd"), reuse=True)
