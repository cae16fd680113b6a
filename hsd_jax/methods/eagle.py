"""EAGLE-style (EAGLE-1/2): a token-conditioned feature drafter, z_q = FC([f_q; e(x_{q+1})]).

Every frontier node of the tree runs the drafter on (its parent's feature, its token), so a
tree of depth D costs D-1 sequential drafter forwards per round; after verification the
accepted path's (feature, next token) pairs are ingested and the last output is the next
root feature.
"""
from __future__ import annotations

from typing import NamedTuple

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


def tree_from_root(dparams, dcfg, view, cache: KVCache, root_g, root_tokens, spec):
    """EAGLE-2 style: every frontier node runs the drafter on (its parent's feature, its token).

    The drafter sees the frontier nodes of all depths so far as one tree (its own tree
    attention); a one-layer drafter's K/V depend only on each input, so recomputing them per
    depth is exact. Returns (tree, drafter steps)."""
    b, k = root_tokens.shape[0], spec.tree_top_k
    toks, scores = tree_lib.topk_draft(drafter.readout(dparams, dcfg, view, root_g, root_tokens), view.d2t, k)
    depth_tokens, depth_scores, depth_parents = [toks], [scores], [jnp.full_like(toks, -1)]
    cand_parent_f = jnp.full_like(toks, -1)
    parent_g = jnp.broadcast_to(root_g[:, None], (b, k, root_g.shape[-1]))
    z_all, par_all, pos_all = [], [], []
    for j in range(1, spec.tree_depth):
        fidx, ftok, fscore = tree_lib.expand_frontier(depth_tokens[-1], depth_scores[-1], k)
        fpar = jnp.take_along_axis(cand_parent_f, fidx, axis=1)
        pg = parent_g if j == 1 else take_slots(parent_g, fpar)
        z_all.append(drafter.eagle_inputs(dparams, dcfg, view, pg, ftok))
        par_all.append(jnp.full_like(ftok, -1) if j == 1 else fpar + (j - 2) * k)
        pos_all.append(jnp.full_like(ftok, j - 1))
        pos = cache.lengths[:, None] + jnp.concatenate(pos_all, 1)
        out, _ = drafter.run_layers(dparams, dcfg, jnp.concatenate(z_all, 1), pos, cache,
                                    jnp.concatenate(par_all, 1))
        parent_g = out[:, -k:]
        ctok, clogp = tree_lib.topk_draft(drafter.readout(dparams, dcfg, view, parent_g, ftok), view.d2t, k)
        t, s, cand_parent_f = tree_lib.child_candidates(fscore, clogp, ctok)
        depth_tokens.append(t), depth_scores.append(s)
        depth_parents.append(jnp.take_along_axis(fidx, cand_parent_f, axis=1))
    tree = tree_lib.dynamic_tree(depth_tokens, depth_scores, depth_parents, root_tokens, spec.slots)
    return tree, jnp.full((b,), spec.tree_depth - 1, jnp.int32)


def ingest_accepted(dparams, dcfg, view, cache: KVCache, tree, acc, feats, live):
    """Ingest (f_{p+i}, x_{p+i+1}) for i = 0..m; the last output is the next root feature."""
    m = acc.num_accepted
    z = drafter.eagle_inputs(dparams, dcfg, view, take_slots(feats, acc.path), emitted_tokens(tree, acc))
    pos = cache.lengths[:, None] + jnp.arange(z.shape[1], dtype=jnp.int32)[None]
    g, cache = drafter.run_layers(dparams, dcfg, z, pos, cache)
    return advance(cache, jnp.where(live, m + 1, 0)), take_slots(g, m[:, None])[:, 0]


def init(rnd, prefill_out, root) -> State:
    """Run the drafter over the prompt's (feature, next token) pairs; the root's is the last."""
    b, t = rnd.prompt_tokens.shape
    lcfg = rnd.dcfg.layer_config()
    cache = init_cache(lcfg.num_layers, b, lcfg.num_kv_heads, rnd.capacity, lcfg.head_dim, jnp.float32)
    lens = rnd.prompt_lens.astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    nxt = jnp.concatenate([rnd.prompt_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
    nxt = nxt.at[jnp.arange(b), lens - 1].set(root)
    z = drafter.eagle_inputs(rnd.dparams, rnd.dcfg, rnd.view, prefill_out.features, nxt)
    g, cache = drafter.run_layers(rnd.dparams, rnd.dcfg, z, pos, cache)
    return State(cache.replace(lengths=lens), take_slots(g, (lens - 1)[:, None])[:, 0])


def draft(rnd, state: State, root, history, key) -> Draft:
    tree, steps = tree_from_root(rnd.dparams, rnd.dcfg, rnd.view, state.cache, state.root_g, root, rnd.spec)
    return Draft(tree, state, steps)


def update(rnd, state: State, drft: Draft, acc, vout, live):
    cache, root_g = ingest_accepted(rnd.dparams, rnd.dcfg, rnd.view, state.cache, drft.tree, acc, vout.features, live)
    return State(cache, root_g), live.astype(jnp.int32)


def _check(d, spec):
    if d.config.readout_context > 1:
        raise InputError(f"this eagle drafter's read-out sees {d.config.readout_context} path tokens "
                         "(readout_context > 1): the engine serves that for hsd only")


METHOD = Method("eagle", "EAGLE-1/2 style token-conditioned feature drafter, dynamic tree",
                init, draft, update, feature_drafter("eagle"),
                scratch=lambda spec: (spec.tree_depth - 1) * spec.tree_top_k, check=_check)
