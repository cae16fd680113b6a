"""Decode loops compiled as one `jax.jit` each: prefill, then `lax.while_loop` over steps.

Prompts arrive right-padded with their true lengths; the KV cache keeps a length per
sequence, so a batch of unequal prompts needs no left padding and no per-token Python.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hsd_jax import tree as tree_lib
from hsd_jax.cache import KVCache, advance, compact, init_cache
from hsd_jax.config import ModelConfig, SamplingConfig
from hsd_jax.models import drafter, llama, ngram
from hsd_jax.models.layers import jnp_dtype
from hsd_jax.sampling import sample, sample_from_probs, target_probs
from hsd_jax.tree import Tree
from hsd_jax.verify import Accepted, accept_chain_stochastic, accept_greedy, accept_tree_stochastic


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


# ---------------------------------------------------------------------------------------------
# Speculative decoding: draft -> verify -> accept -> commit -> update drafter, one jit.
# ---------------------------------------------------------------------------------------------

METHODS = ("ar", "sd", "eagle", "hsd", "ngram")
REUSE_POLICIES = ("none", "chain", "refresh")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static shape of a speculative round. `tree_nodes` counts draft nodes (the root excluded)."""

    method: str = "hsd"
    reuse: str = "refresh"
    tree_nodes: int = 10
    tree_depth: int = 4
    tree_top_k: int = 4
    gamma: int = 4

    def __post_init__(self):
        from hsd_jax.config import ConfigError

        if self.method not in METHODS[1:]:
            raise ConfigError(f"speculative method must be one of {METHODS[1:]}, got {self.method!r}")
        if self.reuse not in REUSE_POLICIES:
            raise ConfigError(f"reuse must be one of {REUSE_POLICIES}, got {self.reuse!r}")
        for name in ("tree_nodes", "tree_depth", "tree_top_k", "gamma"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.method != "sd":
            most = self.tree_top_k + (self.tree_depth - 1) * self.tree_top_k ** 2
            if self.tree_nodes > most:
                raise ConfigError(f"tree_nodes {self.tree_nodes} exceeds the {most} candidates that depth "
                                  f"{self.tree_depth} and tree_top_k {self.tree_top_k} produce")
            if self.tree_nodes < self.tree_depth:
                raise ConfigError(f"tree_nodes {self.tree_nodes} cannot reach depth {self.tree_depth}")

    @property
    def depth(self) -> int:
        return self.gamma if self.method == "sd" else self.tree_depth

    @property
    def cache_slack(self) -> int:
        """Cache slots a round may touch past the committed length (verify tree, overshoot, drafter scratch)."""
        scratch = (self.tree_depth - 1) * self.tree_top_k if self.method == "eagle" else 0
        return max(self.slots + self.depth + 1, scratch)

    @property
    def slots(self) -> int:
        """Tokens in one verify forward: the root plus the draft nodes."""
        return self.gamma + 1 if self.method == "sd" else self.tree_nodes + 1


class SpecStats(NamedTuple):
    rounds: jax.Array            # [B] verify forwards
    accepted_hist: jax.Array     # [B, D+1] rounds by number of accepted draft tokens
    drafter_steps: jax.Array     # [B] sequential drafter forwards (ingest calls and chain/tree steps)


class SpecOutput(NamedTuple):
    tokens: jax.Array
    num_tokens: jax.Array
    stats: SpecStats


def _take_slots(x, idx):
    """x [B, T, ...] gathered at idx [B, M] (negative -> slot 0)."""
    idx = jnp.maximum(idx, 0)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _at_lengths(cache: KVCache, offset) -> KVCache:
    """The same cache with writes aimed `offset` slots past the committed length."""
    return cache.replace(lengths=cache.lengths + offset)


def _topk_draft(logits, view, k):
    """Top-k draft tokens (target ids) and their log-probs from draft-vocab logits [..., V_d]."""
    logp = jax.nn.log_softmax(logits, -1)
    vals, idx = jax.lax.top_k(logp, k)
    return jnp.take(view.d2t, idx), vals


def hsd_chain_extend(dparams, dcfg, cache: KVCache, chain, start):
    """Fill chain[:, i+1] for i >= start[b] by feeding chain[:, i] at slot length + i.

    The chain is token-free, so this never waits for drafted tokens. Steps no sequence
    needs are skipped (lax.cond), so reuse saves real work. Entries written past the
    committed length are scratch. Returns (chain, cache, steps [B]).
    """
    b, depth, _ = chain.shape
    steps = jnp.zeros((b,), jnp.int32)
    root_parent = jnp.full((b, 1), -1, jnp.int32)
    for i in range(depth - 1):
        need = start <= i

        def step(carry, i=i, need=need):
            chain, cache = carry
            view = _at_lengths(cache, i)
            g, view = drafter.run_layers(dparams, dcfg, chain[:, i][:, None], view.lengths[:, None], view,
                                         root_parent)
            chain = chain.at[:, i + 1].set(jnp.where(need[:, None], g[:, 0], chain[:, i + 1]))
            return chain, view.replace(lengths=cache.lengths)

        chain, cache = jax.lax.cond(jnp.any(need), step, lambda c: c, (chain, cache))
        steps = steps + need.astype(jnp.int32)
    return chain, cache, steps


def grow_tree(first, children, root_tokens, spec: SpecConfig, root_context=None) -> Tree:
    """A dynamic tree from top-k drafts: `first` = (tokens, log-probs) [B, k] at depth 1 and
    `children(j, frontier_tokens, frontier_context)` -> the same [B, F, k] for the children at
    depth j+1. With `root_context` [B, n] (the committed tokens before the root, most recent
    first), frontier_context [B, F, n] holds each frontier node's path tokens before it;
    otherwise it is None."""
    k = spec.tree_top_k
    depth_tokens, depth_scores, depth_parents = [first[0]], [first[1]], [jnp.full_like(first[0], -1)]
    ctx = None
    if root_context is not None:  # the path before each depth-1 candidate: root, then the root's context
        path = jnp.concatenate([root_tokens[:, None], root_context[:, :-1]], 1)
        ctx = jnp.broadcast_to(path[:, None], first[0].shape + path.shape[-1:])
    for j in range(1, spec.tree_depth):
        fidx, ftok, fscore = tree_lib.expand_frontier(depth_tokens[-1], depth_scores[-1], k)
        fctx = None if ctx is None else jnp.take_along_axis(ctx, fidx[..., None], 1)
        ctok, clogp = children(j, ftok, fctx)
        t, s, par = tree_lib.child_candidates(fscore, clogp, ctok, frontier_idx=fidx)
        if ctx is not None:  # a child's path before it: its parent, then the parent's path
            path = jnp.concatenate([ftok[..., None], fctx[..., :-1]], -1)
            ctx = jnp.repeat(path, ctok.shape[-1], axis=1)
        depth_tokens.append(t), depth_scores.append(s), depth_parents.append(par)
    return tree_lib.dynamic_tree(depth_tokens, depth_scores, depth_parents, root_tokens, spec.slots)


def hsd_draft(dparams, dcfg, view, chain, root_tokens, spec: SpecConfig, root_context=None) -> Tree:
    """Grow a dynamic tree from the stored chain g_p..g_{p+D-1}: depth j+1 reads g_{p+j} with
    each frontier token injected; one batched read-out per depth. A read-out that sees earlier
    path tokens (`readout_context` > 1) gets them from `root_context` [B, context-1] and the tree."""
    k = spec.tree_top_k

    def children(j, ftok, fctx):
        g = jnp.broadcast_to(chain[:, j][:, None], ftok.shape + chain.shape[-1:])
        return _topk_draft(drafter.readout(dparams, dcfg, view, g, ftok, fctx), view, k)

    first = _topk_draft(drafter.readout(dparams, dcfg, view, chain[:, 0], root_tokens, root_context), view, k)
    return grow_tree(first, children, root_tokens, spec, root_context)


def recent_tokens(prompt_tokens, prompt_lens, tokens, count, n: int):
    """[B, n] the committed tokens before the newest one (tokens[count - 1]), most recent first,
    reaching back into the prompt (its first token repeats past the start, as in training)."""
    back = count[:, None] - 2 - jnp.arange(n)[None, :]          # index into the generated tokens
    gen = jnp.take_along_axis(tokens, jnp.maximum(back, 0), 1)
    ppos = jnp.maximum(prompt_lens[:, None] + back, 0)           # else into the prompt
    prompt = jnp.take_along_axis(prompt_tokens, ppos, 1)
    return jnp.where(back >= 0, gen, prompt)


def ngram_draft(table, root_tokens, spec: SpecConfig) -> Tree:
    """The n-gram floor: every node's children are its token's most frequent successors."""
    k = spec.tree_top_k
    return grow_tree(ngram.children(table, root_tokens, k), lambda j, ftok, _: ngram.children(table, ftok, k),
                     root_tokens, spec)


def eagle_draft(dparams, dcfg, view, cache: KVCache, root_g, root_tokens, spec: SpecConfig):
    """EAGLE-2 style: every frontier node runs the drafter on (its parent's feature, its token).

    The drafter sees the frontier nodes of all depths so far as one tree (its own tree
    attention); a one-layer drafter's K/V depend only on each input, so recomputing them per
    depth is exact. Returns (tree, drafter steps)."""
    b, k = root_tokens.shape[0], spec.tree_top_k
    toks, scores = _topk_draft(drafter.readout(dparams, dcfg, view, root_g, root_tokens), view, k)
    depth_tokens, depth_scores, depth_parents = [toks], [scores], [jnp.full_like(toks, -1)]
    cand_parent_f = jnp.full_like(toks, -1)
    parent_g = jnp.broadcast_to(root_g[:, None], (b, k, root_g.shape[-1]))
    z_all, par_all, pos_all = [], [], []
    for j in range(1, spec.tree_depth):
        fidx, ftok, fscore = tree_lib.expand_frontier(depth_tokens[-1], depth_scores[-1], k)
        fpar = jnp.take_along_axis(cand_parent_f, fidx, axis=1)
        pg = parent_g if j == 1 else _take_slots(parent_g, fpar)
        z_all.append(drafter.eagle_inputs(dparams, dcfg, view, pg, ftok))
        par_all.append(jnp.full_like(ftok, -1) if j == 1 else fpar + (j - 2) * k)
        pos_all.append(jnp.full_like(ftok, j - 1))
        pos = cache.lengths[:, None] + jnp.concatenate(pos_all, 1)
        out, _ = drafter.run_layers(dparams, dcfg, jnp.concatenate(z_all, 1), pos, cache,
                                    jnp.concatenate(par_all, 1))
        parent_g = out[:, -k:]
        ctok, clogp = _topk_draft(drafter.readout(dparams, dcfg, view, parent_g, ftok), view, k)
        t, s, cand_parent_f = tree_lib.child_candidates(fscore, clogp, ctok)
        depth_tokens.append(t), depth_scores.append(s)
        depth_parents.append(jnp.take_along_axis(fidx, cand_parent_f, axis=1))
    tree = tree_lib.dynamic_tree(depth_tokens, depth_scores, depth_parents, root_tokens, spec.slots)
    return tree, jnp.full((b,), spec.tree_depth - 1, jnp.int32)


def sd_draft(dparams, dcfg: ModelConfig, cache: KVCache, root_tokens, key, spec: SpecConfig,
             sampling: SamplingConfig):
    """Standard SD: the draft LM samples a chain of gamma tokens. Returns (tokens [B, G], q [B, G, V], cache)."""
    b = root_tokens.shape[0]
    toks, qs, last = [], [], root_tokens
    for i in range(spec.gamma):
        view = _at_lengths(cache, i)
        out = llama.forward(dparams, dcfg, last[:, None], view.lengths[:, None], view, jnp.full((b, 1), -1, jnp.int32))
        cache = out.cache.replace(lengths=cache.lengths)
        logits = llama.logits_from_features(dparams, dcfg, out.features[:, 0])
        key, sub = jax.random.split(key)
        q = target_probs(logits, sampling)
        last = jnp.argmax(logits, -1).astype(jnp.int32) if sampling.greedy else sample_from_probs(q, sub)
        toks.append(last), qs.append(q)
    return jnp.stack(toks, 1), jnp.stack(qs, 1), cache


def verify_tree(tparams, tcfg: ModelConfig, cache: KVCache, tree: Tree):
    """One target forward over all tree slots with tree attention. Returns (logits [B,T,V], ForwardOutput)."""
    pos = tree_lib.positions(tree, cache.lengths)
    out = llama.forward(tparams, tcfg, tree.tokens, pos, cache, tree.parents)
    return llama.logits_from_features(tparams, tcfg, out.features), out


def accept(tree: Tree, logits, key, sampling: SamplingConfig, draft=None) -> Accepted:
    """Greedy or lossless stochastic acceptance; `draft` = (tokens, q) for sampled chains (SD)."""
    if sampling.greedy:
        return accept_greedy(tree, logits)
    p = target_probs(logits, sampling)
    if draft is not None:
        return accept_chain_stochastic(draft[0], draft[1], p, key)
    return accept_tree_stochastic(tree, p, key)


def commit(cache: KVCache, acc: Accepted, live) -> KVCache:
    """Move the accepted path's K/V (root included) right after the committed prefix."""
    return compact(cache, acc.path, jnp.where(live, acc.num_accepted + 1, 0))


def emitted_tokens(tree: Tree, acc: Accepted):
    """Tokens a round commits [B, D+1]: the accepted draft tokens, then the bonus/correction."""
    d = acc.path.shape[1] - 1
    drafted = jnp.take_along_axis(tree.tokens, jnp.maximum(acc.path[:, 1:], 0), axis=1)
    i = jnp.arange(d + 1)[None, :]
    drafted = jnp.concatenate([drafted, jnp.zeros_like(drafted[:, :1])], 1)
    return jnp.where(i == acc.num_accepted[:, None], acc.token[:, None], drafted)


def hsd_ingest(dparams, dcfg, cache: KVCache, feats, aux, count):
    """Feed true target features [B, M, d] at slots length..length+M-1; commit `count` of them.
    Returns (drafter outputs [B, M, d], cache)."""
    b, m = feats.shape[:2]
    z = drafter.input_features(dparams, dcfg, feats, aux)
    pos = cache.lengths[:, None] + jnp.arange(m, dtype=jnp.int32)[None]
    g, cache = drafter.run_layers(dparams, dcfg, z, pos, cache)
    return g, advance(cache, count)


def hsd_update(dparams, dcfg, cache: KVCache, chain, acc: Accepted, feats, aux, live, reuse: str):
    """After verification: ingest the true features f_p..f_{p+m}, then rebuild the chain.

    none: g_{p'} from the ingest, then D-1 chain steps. chain: keep the stale g's for positions
    after p+m (they never saw a token) and extend by the m+1 consumed. refresh: as chain, but
    the chain's first state is the fresh g_{p'} from the ingest (free). Returns (cache, chain, steps).
    """
    b, depth = chain.shape[:2]
    m = acc.num_accepted
    count = jnp.where(live, m + 1, 0)
    fp = _take_slots(feats, acc.path)
    ap = jnp.stack([_take_slots(a, acc.path) for a in aux]) if aux.shape[0] else aux
    g_all, cache = hsd_ingest(dparams, dcfg, cache, fp, ap, count)
    fresh = _take_slots(g_all, m[:, None])[:, 0]
    if reuse == "none":
        kept = jnp.zeros((b,), bool)
    else:
        kept = m <= depth - 2
        shifted = _take_slots(chain, jnp.minimum(jnp.arange(depth)[None] + m[:, None] + 1, depth - 1))
        chain = jnp.where(kept[:, None, None], shifted, chain)
    start = jnp.where(kept, depth - 2 - m, 0)
    first = fresh if reuse != "chain" else jnp.where(kept[:, None], chain[:, 0], fresh)
    chain = chain.at[:, 0].set(first)
    chain, cache, steps = hsd_chain_extend(dparams, dcfg, cache, chain, jnp.where(live, start, depth))
    return cache, chain, steps + live.astype(jnp.int32)


def eagle_update(dparams, dcfg, view, cache: KVCache, tree: Tree, acc: Accepted, feats, live):
    """Ingest (f_{p+i}, x_{p+i+1}) for i = 0..m; the last output is the next root feature."""
    m = acc.num_accepted
    nxt = emitted_tokens(tree, acc)
    z = drafter.eagle_inputs(dparams, dcfg, view, _take_slots(feats, acc.path), nxt)
    pos = cache.lengths[:, None] + jnp.arange(z.shape[1], dtype=jnp.int32)[None]
    g, cache = drafter.run_layers(dparams, dcfg, z, pos, cache)
    return advance(cache, jnp.where(live, m + 1, 0)), _take_slots(g, m[:, None])[:, 0]


def sd_update(dparams, dcfg: ModelConfig, cache: KVCache, draft_tokens, acc: Accepted, live):
    """Commit the draft LM's entries for x_p, d_1..d_m; feed d_G first when the whole chain passed."""
    b, g = draft_tokens.shape
    m = acc.num_accepted
    full = live & (m == g)

    def feed_last(cache):
        view = _at_lengths(cache, g)
        out = llama.forward(dparams, dcfg, draft_tokens[:, -1:], view.lengths[:, None], view,
                            jnp.full((b, 1), -1, jnp.int32))
        return out.cache.replace(lengths=cache.lengths)

    cache = jax.lax.cond(jnp.any(full), feed_last, lambda c: c, cache)
    return advance(cache, jnp.where(live, m + 1, 0)), full.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "spec", "sampling", "max_new_tokens", "capacity"))
def spec_generate(tparams, dparams, d2t, prompt_tokens, prompt_lens, key, *, tcfg: ModelConfig, dcfg,
                  spec: SpecConfig, sampling: SamplingConfig, max_new_tokens: int, capacity: int) -> SpecOutput:
    """Speculative decoding (sd, eagle, hsd or ngram) for a batch, all rounds in one `lax.while_loop`."""
    b, t_prompt = prompt_tokens.shape
    depth = spec.depth
    dt = jnp_dtype(tcfg)
    tcache = init_cache(tcfg.num_layers, b, tcfg.num_kv_heads, capacity, tcfg.head_dim, dt)
    logits, out = prefill(tparams, tcfg, prompt_tokens, prompt_lens, tcache)
    key, sub = jax.random.split(key)
    root = sample(logits, sub, sampling)
    lens = prompt_lens.astype(jnp.int32)
    last_idx = (lens - 1)[:, None]
    zero_steps = jnp.zeros((b,), jnp.int32)

    if spec.method == "sd":
        dcache = init_cache(dcfg.num_layers, b, dcfg.num_kv_heads, capacity, dcfg.head_dim, dt)
        _, dout = prefill(dparams, dcfg, prompt_tokens, prompt_lens, dcache)
        dstate = (dout.cache,)
        view = None
    elif spec.method == "ngram":
        dstate, view = (), None
    else:
        lcfg = dcfg.layer_config()
        dcache = init_cache(lcfg.num_layers, b, lcfg.num_kv_heads, capacity, lcfg.head_dim, jnp.float32)
        view = drafter.target_view(tparams, tcfg, d2t)
        pos = jnp.broadcast_to(jnp.arange(t_prompt, dtype=jnp.int32), (b, t_prompt))
        if spec.method == "hsd":
            z = drafter.input_features(dparams, dcfg, out.features, out.aux_features)
            g, dcache = drafter.run_layers(dparams, dcfg, z, pos, dcache)
            dcache = dcache.replace(lengths=lens)
            chain = jnp.zeros((b, depth, tcfg.hidden_size), jnp.float32)
            chain = chain.at[:, 0].set(_take_slots(g, last_idx)[:, 0])
            chain, dcache, _ = hsd_chain_extend(dparams, dcfg, dcache, chain, zero_steps)
            dstate = (dcache, chain)
        else:
            nxt = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
            nxt = nxt.at[jnp.arange(b), lens - 1].set(root)
            z = drafter.eagle_inputs(dparams, dcfg, view, out.features, nxt)
            g, dcache = drafter.run_layers(dparams, dcfg, z, pos, dcache)
            dstate = (dcache.replace(lengths=lens), _take_slots(g, last_idx)[:, 0])

    tokens = jnp.full((b, max_new_tokens + depth + 1), -1, jnp.int32).at[:, 0].set(root)
    count = jnp.ones((b,), jnp.int32)
    done = is_eos(root, tcfg.eos_token_ids) | (max_new_tokens <= 1)
    stats = SpecStats(jnp.zeros((b,), jnp.int32), jnp.zeros((b, depth + 1), jnp.int32), zero_steps)

    def body(state):
        tcache, dstate, root, tokens, count, done, key, stats = state
        live = ~done
        key, k_draft, k_acc = jax.random.split(key, 3)
        draft = None
        if spec.method == "hsd":
            context = None
            if dcfg.readout_context > 1:
                context = recent_tokens(prompt_tokens, lens, tokens, count, dcfg.readout_context - 1)
            tree = hsd_draft(dparams, dcfg, view, dstate[1], root, spec, context)
            dsteps = zero_steps
        elif spec.method == "eagle":
            tree, dsteps = eagle_draft(dparams, dcfg, view, dstate[0], dstate[1], root, spec)
        elif spec.method == "ngram":
            tree, dsteps = ngram_draft(dparams, root, spec), zero_steps
        else:
            dtoks, q, dcache = sd_draft(dparams, dcfg, dstate[0], root, k_draft, spec, sampling)
            dstate = (dcache,)
            tree = tree_lib.chain_tree(dtoks, root)
            draft = (dtoks, q)
            dsteps = jnp.full((b,), spec.gamma, jnp.int32)
        logits, vout = verify_tree(tparams, tcfg, tcache, tree)
        acc = accept(tree, logits, k_acc, sampling, draft)
        tcache = commit(vout.cache, acc, live)
        if spec.method == "hsd":
            dcache, chain, more = hsd_update(dparams, dcfg, dstate[0], dstate[1], acc, vout.features,
                                             vout.aux_features, live, spec.reuse)
            dstate = (dcache, chain)
        elif spec.method == "eagle":
            dcache, root_g = eagle_update(dparams, dcfg, view, dstate[0], tree, acc, vout.features, live)
            dstate, more = (dcache, root_g), live.astype(jnp.int32)
        elif spec.method == "ngram":
            more = zero_steps
        else:
            dcache, more = sd_update(dparams, dcfg, dstate[0], draft[0], acc, live)
            dstate = (dcache,)
        new = emitted_tokens(tree, acc)
        i = jnp.arange(depth + 1)[None, :]
        n = acc.num_accepted + 1
        eos_at = jnp.where(is_eos(new, tcfg.eos_token_ids) & (i < n[:, None]), i, depth + 1).min(1)
        n = jnp.minimum(n, eos_at + 1)
        slots = jnp.where(live[:, None] & (i < n[:, None]), count[:, None] + i, tokens.shape[1])
        tokens = tokens.at[jnp.arange(b)[:, None], slots].set(new, mode="drop")
        count = count + jnp.where(live, n, 0)
        done = done | (eos_at <= depth) | (count >= max_new_tokens)
        stats = SpecStats(stats.rounds + live, stats.accepted_hist.at[jnp.arange(b), acc.num_accepted].add(live),
                          stats.drafter_steps + jnp.where(live, dsteps + more, 0))
        root = jnp.where(live, acc.token, root)
        return tcache, dstate, root, tokens, count, done, key, stats

    state = (out.cache, dstate, root, tokens, count, done, key, stats)
    state = jax.lax.while_loop(lambda s: jnp.any(~s[5]), body, state)
    return SpecOutput(state[3][:, :max_new_tokens], jnp.minimum(state[4], max_new_tokens), state[7])
