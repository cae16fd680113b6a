"""EAGLE-style (EAGLE-1/2): a token-conditioned feature drafter, z_q = FC([f_q; e(x_{q+1})]).

Every frontier node of the tree runs the drafter on (its parent's feature, its token), so a
tree of depth D costs D-1 sequential drafter forwards per round; after verification the
accepted path's (feature, next token) pairs are ingested and the last output is the next
root feature.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from hsd_jax import tree as tree_lib
from hsd_jax.cache import KVCache, advance, init_cache, take_slots
from hsd_jax.config import InputError
from hsd_jax.methods.base import Draft, Method
from hsd_jax.methods.features import feature_drafter
from hsd_jax.models import drafter
from hsd_jax.verify import emitted_tokens


class State(NamedTuple):
    cache: KVCache       # the drafter layer's KV cache over the committed positions
    root_g: jax.Array    # [B, d] the drafter's feature for the root (predicts the token after it)


class Ops(NamedTuple):
    """What a token-conditioned drafter does, bound to a round's weights (EAGLE-1/2 here, EAGLE-3
    in `methods.eagle3`): the tree search, ingestion and prompt pass below are shared.

    step(hidden [B,T,d], tokens [B,T], positions, cache, parents) -> (outputs [B,T,d], cache): the layer
    on (feature of q, token x_{q+1}) pairs; logits(g, tokens) -> draft-vocab logits of the next token;
    true_hidden(forward output) -> [B,T,d] the layer's hidden input at verified positions;
    cache_shape: (layers, KV heads, head dim) of the drafter's cache."""

    step: Callable
    logits: Callable
    true_hidden: Callable
    cache_shape: tuple


def tree_from_root(ops: Ops, cache: KVCache, root_g, root_tokens, spec, d2t):
    """EAGLE-2 style: every frontier node runs the drafter on (its parent's feature, its token).

    The drafter sees the frontier nodes of all depths so far as one tree (its own tree
    attention); a one-layer drafter's K/V depend only on each input, so recomputing them per
    depth is exact. Each step's K/V land at scratch slots past the committed length, so the written
    cache goes on (and is returned): discarding it made XLA copy the whole drafter cache before every
    step. Returns (tree, drafter steps, cache)."""
    b, k = root_tokens.shape[0], spec.tree_top_k
    toks, scores = tree_lib.topk_draft(ops.logits(root_g, root_tokens), d2t, k)
    depth_tokens, depth_scores, depth_parents = [toks], [scores], [jnp.full_like(toks, -1)]
    cand_parent_f = jnp.full_like(toks, -1)
    parent_g = jnp.broadcast_to(root_g[:, None], (b, k, root_g.shape[-1]))
    hid_all, tok_all, par_all, pos_all = [], [], [], []
    for j in range(1, spec.tree_depth):
        fidx, ftok, fscore = tree_lib.expand_frontier(depth_tokens[-1], depth_scores[-1], k)
        fpar = jnp.take_along_axis(cand_parent_f, fidx, axis=1)
        hid_all.append(parent_g if j == 1 else take_slots(parent_g, fpar))
        tok_all.append(ftok)
        par_all.append(jnp.full_like(ftok, -1) if j == 1 else fpar + (j - 2) * k)
        pos_all.append(jnp.full_like(ftok, j - 1))
        pos = cache.lengths[:, None] + jnp.concatenate(pos_all, 1)
        out, written = ops.step(jnp.concatenate(hid_all, 1), jnp.concatenate(tok_all, 1), pos, cache,
                                jnp.concatenate(par_all, 1))
        cache = written.replace(lengths=cache.lengths)
        parent_g = out[:, -k:]
        ctok, clogp = tree_lib.topk_draft(ops.logits(parent_g, ftok), d2t, k)
        t, s, cand_parent_f = tree_lib.child_candidates(fscore, clogp, ctok)
        depth_tokens.append(t), depth_scores.append(s)
        depth_parents.append(jnp.take_along_axis(fidx, cand_parent_f, axis=1))
    tree = tree_lib.dynamic_tree(depth_tokens, depth_scores, depth_parents, root_tokens, spec.slots)
    return tree, jnp.full((b,), spec.tree_depth - 1, jnp.int32), cache


def ingest_accepted(ops: Ops, cache: KVCache, tree, acc, vout, live):
    """Ingest (f_{p+i}, x_{p+i+1}) for i = 0..m; the last output is the next root feature."""
    m = acc.num_accepted
    hidden = take_slots(ops.true_hidden(vout), acc.path)
    pos = cache.lengths[:, None] + jnp.arange(hidden.shape[1], dtype=jnp.int32)[None]
    g, cache = ops.step(hidden, emitted_tokens(tree, acc), pos, cache, None)
    return advance(cache, jnp.where(live, m + 1, 0)), take_slots(g, m[:, None])[:, 0]


def round_functions(make_ops: Callable):
    """The method's init / draft / update for a drafter given by `make_ops(dparams, dcfg, view) -> Ops`."""

    def bound(rnd) -> Ops:
        return make_ops(rnd.dparams, rnd.dcfg, rnd.view)

    def init(rnd, prefill_out, root) -> State:
        """Run the drafter over the prompt's (feature, next token) pairs; the root's is the last."""
        ops = bound(rnd)
        b, t = rnd.prompt_tokens.shape
        layers, kv_heads, head_dim = ops.cache_shape
        cache = init_cache(layers, b, kv_heads, rnd.capacity, head_dim, jnp.float32)
        lens = rnd.prompt_lens.astype(jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        nxt = jnp.concatenate([rnd.prompt_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
        nxt = nxt.at[jnp.arange(b), lens - 1].set(root)
        g, cache = ops.step(ops.true_hidden(prefill_out), nxt, pos, cache, None)
        return State(cache.replace(lengths=lens), take_slots(g, (lens - 1)[:, None])[:, 0])

    def draft(rnd, state: State, root, history, key) -> Draft:
        tree, steps, cache = tree_from_root(bound(rnd), state.cache, state.root_g, root, rnd.spec, rnd.view.d2t)
        return Draft(tree, state._replace(cache=cache), steps)

    def update(rnd, state: State, drft: Draft, acc, vout, live):
        cache, root_g = ingest_accepted(bound(rnd), state.cache, drft.tree, acc, vout, live)
        return State(cache, root_g), live.astype(jnp.int32)

    return init, draft, update


def ops(dp, dc, view) -> Ops:
    """EAGLE-1/2: z = FC([feature; c * rms e(token)]) into the drafter's decoder layer(s)."""
    lcfg = dc.layer_config()

    def step(hidden, tokens, pos, cache, parents):
        return drafter.run_layers(dp, dc, drafter.eagle_inputs(dp, dc, view, hidden, tokens), pos, cache, parents)

    return Ops(step, lambda g, tokens: drafter.readout(dp, dc, view, g, tokens), lambda out: out.features,
               (lcfg.num_layers, lcfg.num_kv_heads, lcfg.head_dim))


init, draft, update = round_functions(ops)


def _check(d, spec):
    if d.config.readout_context > 1:
        raise InputError(f"this eagle drafter's read-out sees {d.config.readout_context} path tokens "
                         "(readout_context > 1): the engine serves that for hsd only")


METHOD = Method("eagle", "EAGLE-1/2 style token-conditioned feature drafter, dynamic tree",
                init, draft, update, feature_drafter("eagle"),
                scratch=lambda spec: (spec.tree_depth - 1) * spec.tree_top_k, check=_check)
