"""Decoding as two `jax.jit` programs per method: a prefill, then a `lax.while_loop` over steps.

`ar_prefill` / `spec_prefill` take prompts right-padded to a bucket with their true lengths
(one program per bucket) and return a `Prefilled` whose shapes depend only on the batch and the
cache capacity; `ar_decode` / `spec_decode` take it and a traced `max_new_tokens`, so one
compiled loop per (model, method, spec, sampling, batch, capacity) serves every prompt length
and every bound. The KV cache keeps a length per sequence, so a batch of unequal prompts needs
no left padding and no per-token Python.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hsd_jax import methods
from hsd_jax import tree as tree_lib
from hsd_jax.cache import KVCache, advance, compact
from hsd_jax.config import ConfigError, ModelConfig, SamplingConfig
from hsd_jax.models import drafter, llama
from hsd_jax.sampling import sample
from hsd_jax.tree import Tree
from hsd_jax.verify import Accepted, accept, accept_greedy, emitted_tokens


class DecodeOutput(NamedTuple):
    tokens: jax.Array          # [B, capacity] new token ids, -1 from num_tokens on
    num_tokens: jax.Array      # [B] tokens generated (EOS included)
    state: Any = None   # the loop's final cache and key: the donated `Prefilled`'s buffers, used in place


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(eos_ids, jnp.int32), axis=-1)


prefill = llama.prefill


EXACT_ROWS = 32   # `generate(..., exact=True)`: every target forward after the prefill at this many rows
# ... with the attention that reduces over each row's keys in position order, so that a token's attention
# is the same in a tree verify as in ar's step (`pallas_kernels.tree_attention.tree_attention_positional`)
EXACT_ATTENTION = "positional"


def decode_forward(params, cfg: ModelConfig, tokens, cache: KVCache, rows: int = 1) -> llama.ForwardOutput:
    """One token per sequence [B] at position lengths[b], in a forward of `rows` rows: row 0 the
    token, rows 1.. padding shaped as `tree.pad_tree`'s unreachable slots (token 0 at the same
    position, no parent, seen by no row, inactive) so that the token's arithmetic is that of a
    verify row at this width (`exact`). Their K/V land in scratch slots past the token's."""
    b = tokens.shape[0]
    toks = jnp.zeros((b, rows), jnp.int32).at[:, 0].set(tokens)
    active = None if rows == 1 else jnp.broadcast_to(jnp.arange(rows) < 1, (b, rows))
    return llama.forward(params, cfg, toks, jnp.broadcast_to(cache.lengths[:, None], (b, rows)), cache,
                         jnp.full((b, rows), -1, jnp.int32), active)


def decode_step(params, cfg: ModelConfig, tokens, cache: KVCache, rows: int = 1):
    """Feed one token per sequence [B] (`decode_forward`); returns (features [B, rows, d], cache
    advanced by one). Row 0 is the token's; the padding rows' features are meaningless but finite,
    kept so that the head runs over as many rows as a verify's does."""
    out = decode_forward(params, cfg, tokens, cache, rows)
    return out.features, advance(out.cache, jnp.ones((tokens.shape[0],), jnp.int32))


def next_token(params, cfg: ModelConfig, features, key, sampling: SamplingConfig,
               screen: llama.HeadScreen | None = None):
    """The target's next token after features [B, R, d] (row 0's; the head runs over all R rows,
    as a verify's does): its argmax at T = 0 (certified from the bf16 `screen` where given), else
    a sample from its f32 logits."""
    if sampling.greedy:
        return llama.serving_argmax(params, cfg, features, screen)[:, 0]
    return sample(llama.serving_logits(params, cfg, features)[:, 0], key, sampling)


class Prefilled(NamedTuple):
    """What a prefill program hands its decode loop. Its shapes depend on the batch and the cache
    capacity, never on the prompt's padded length, so one compiled loop serves every prompt."""

    cache: KVCache        # the target's cache [L, B, H, capacity, Dh], committed to the prompt lengths
    dstate: Any           # the method's state after `init` (() for ar)
    root: jax.Array       # [B] the first new token, not yet in the cache
    prompt: jax.Array     # [B, P] the prompts right-padded to P = capacity (P = 0 for ar: unread)
    prompt_lens: jax.Array  # [B]
    key: jax.Array        # the sampling key after the root's draw


def pad_to_capacity(prompt_tokens, capacity: int):
    """[B, T] right-padded prompts widened with padding to [B, capacity] (T <= capacity)."""
    return jnp.pad(prompt_tokens.astype(jnp.int32), ((0, 0), (0, capacity - prompt_tokens.shape[1])))


def _prefill_root(params, cfg: ModelConfig, prompt_tokens, prompt_lens, key, sampling: SamplingConfig,
                  capacity: int):
    """The prompts through the target from an empty cache of `capacity` slots, and the first token:
    at T = 0 through `llama.serving_argmax` (the certified bf16 screen where the CPU kernels pack
    one, the same token as the logits' argmax; XLA's f32 head over one row per prompt copied the
    whole embedding, ~3 ms a call), so the logits are left unused (XLA drops them)."""
    logits, out = llama.prefill_new_cache(params, cfg, prompt_tokens, prompt_lens, capacity)
    key, sub = jax.random.split(key)
    if not sampling.greedy:
        return out, sample(logits, sub, sampling), key
    b = prompt_tokens.shape[0]
    last = out.features[jnp.arange(b), prompt_lens - 1]
    return out, llama.serving_argmax(params, cfg, last, llama.head_screen(params, cfg, b)), key


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "capacity"))
def ar_prefill(params, prompt_tokens, prompt_lens, key, *, cfg: ModelConfig, sampling: SamplingConfig,
               capacity: int) -> Prefilled:
    """Autoregressive decoding's prefill: one program per padded prompt length (bucket)."""
    out, first, key = _prefill_root(params, cfg, prompt_tokens, prompt_lens, key, sampling, capacity)
    b = prompt_tokens.shape[0]
    return Prefilled(out.cache, (), first, jnp.zeros((b, 0), jnp.int32), prompt_lens.astype(jnp.int32), key)


class ArLoop(NamedTuple):
    cache: KVCache
    last: jax.Array     # [B] the newest token, not yet in the cache
    tokens: jax.Array   # [B, capacity]
    count: jax.Array    # [B]
    done: jax.Array     # [B]
    key: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "rows"), donate_argnames=("pre",))
def ar_decode(params, pre: Prefilled, max_new_tokens, *, cfg: ModelConfig, sampling: SamplingConfig,
              rows: int = 1) -> DecodeOutput:
    """Plain autoregressive decoding with a KV cache (the baseline every method must match) from
    `ar_prefill`'s output, up to `max_new_tokens` (traced: one program for every bound); tokens
    come back [B, capacity], -1 from num_tokens on. `rows` > 1 (`exact`): each step's forward and
    head run at that many rows, the verify width of the method compared (`decode_forward`). `pre` is
    donated: the loop writes its cache in place and returns it in `state` (a read-only input cache
    was copied whole into the loop, ~5 ms a call at capacity 2048 and more when its pages were fresh)."""
    b, capacity = pre.cache.batch_size, pre.cache.capacity
    max_new_tokens = jnp.asarray(max_new_tokens, jnp.int32)
    first = pre.root
    tokens = jnp.full((b, capacity), -1, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((b,), jnp.int32)
    done = is_eos(first, cfg.eos_token_ids) | (max_new_tokens <= 1)
    screen = llama.head_screen(params, cfg, b * rows) if sampling.greedy else None

    def body(s: ArLoop) -> ArLoop:
        features, cache = decode_step(params, cfg, s.last, s.cache, rows)
        key, sub = jax.random.split(s.key)
        new = next_token(params, cfg, features, sub, sampling, screen)
        live = ~s.done
        tokens = s.tokens.at[jnp.arange(b), jnp.where(live, s.count, capacity)].set(new, mode="drop")
        count = s.count + live.astype(jnp.int32)
        done = s.done | (live & is_eos(new, cfg.eos_token_ids)) | (count >= max_new_tokens)
        return ArLoop(cache, new, tokens, count, done, key)

    s = jax.lax.while_loop(lambda s: jnp.any(~s.done), body, ArLoop(pre.cache, first, tokens, count, done, pre.key))
    return DecodeOutput(s.tokens, s.count, (s.cache, s.key))


# ---------------------------------------------------------------------------------------------
# Speculative decoding: draft -> verify -> accept -> commit -> update the drafter, one jit.
# The method-specific parts live in `hsd_jax.methods` (one module per method).
# ---------------------------------------------------------------------------------------------

METHODS = methods.METHODS
REUSE_POLICIES = ("none", "chain", "refresh")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static shape of a speculative round. `tree_nodes` counts draft nodes (the root excluded);
    tree methods read tree_*, chain methods (sd) gamma; reuse is HSD's. `lookup_slots` M > 0
    adds M prompt-lookup nodes to a tree method's tree, verified in the same forward.

    `lookup_min_match` n > 0: only rounds where some live sequence's lookup match is at least n
    tokens long verify them (no match never proposes an accepted token, a one-token match few);
    the other rounds verify the method's tree in the same static shape, the lookup slots
    unreachable and skipped by the CPU kernels (`llama.forward`'s `active`), M rows cheaper there;
    elsewhere (no kernels, accelerators) they are computed and unused. No `lax.cond` chooses
    between two forwards: XLA copies the KV cache into and out of a conditional whose branch loops
    over it (BENCHMARKS.md, "The conditional's copy").

    `min_draft_prob` p > 0: draft nodes whose path probability under the drafter is below p leave
    the tree before the verify (`tree.prune_tree`: unreachable, their rows skipped by the CPU
    kernels), so a round costs fewer rows where the drafter is unsure; lookup nodes count as
    certain and keep the draft nodes whose path spells their prefix. Lossless (a choice made
    from the draft alone); it saves time only where verify rows cost (the CPU kernels) and
    otherwise only lowers acceptance."""

    method: str = "hsd"
    reuse: str = "none"   # measured: none >= refresh in tau everywhere, refresh saves drafter steps (BENCHMARKS.md)
    tree_nodes: int = 8
    tree_depth: int = 4
    tree_top_k: int = 3
    gamma: int = 4
    lookup_slots: int = 0
    lookup_min_match: int = 2
    min_draft_prob: float = 0.0
    head_screen: bool = True   # T = 0 on the CPU: certified bf16 screen for the verify argmax (llama.serving_argmax)

    def __post_init__(self):
        if self.method not in methods.REGISTRY:
            raise ConfigError(f"speculative method must be one of {tuple(methods.REGISTRY)}, got {self.method!r}")
        if self.reuse not in REUSE_POLICIES:
            raise ConfigError(f"reuse must be one of {REUSE_POLICIES}, got {self.reuse!r}")
        for name in ("tree_nodes", "tree_depth", "tree_top_k", "gamma"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.drafts_tree:
            most = self.tree_top_k + (self.tree_depth - 1) * self.tree_top_k ** 2
            if self.tree_nodes > most:
                raise ConfigError(f"tree_nodes {self.tree_nodes} exceeds the {most} candidates that depth "
                                  f"{self.tree_depth} and tree_top_k {self.tree_top_k} produce")
            if self.tree_nodes < self.tree_depth:
                raise ConfigError(f"tree_nodes {self.tree_nodes} cannot reach depth {self.tree_depth}")
        if self.lookup_slots < 0:
            raise ConfigError(f"lookup_slots must be >= 0, got {self.lookup_slots}")
        most_match = methods.lookup.LookupConfig().max_ngram
        if not 0 <= self.lookup_min_match <= most_match:
            raise ConfigError(f"lookup_min_match must be in 0..{most_match} (the longest n-gram lookup "
                              f"matches), got {self.lookup_min_match}")
        if not 0.0 <= self.min_draft_prob < 1.0:
            raise ConfigError(f"min_draft_prob must be in [0, 1), got {self.min_draft_prob}")
        if self.min_draft_prob and not self.drafts_tree:
            raise ConfigError(f"min_draft_prob prunes a draft tree; method {self.method!r} drafts a chain")
        if self.lookup_slots and not self.drafts_tree:
            raise ConfigError(f"lookup_slots adds prompt-lookup nodes to a draft tree; method {self.method!r} "
                              "drafts a chain")

    @property
    def drafts_tree(self) -> bool:
        return methods.REGISTRY[self.method].drafts == "tree"

    @property
    def depth(self) -> int:
        return self.tree_depth if self.drafts_tree else self.gamma

    @property
    def slots(self) -> int:
        """Slots of the method's own draft: the root plus the draft nodes."""
        return (self.tree_nodes if self.drafts_tree else self.gamma) + 1

    @property
    def verify_slots(self) -> int:
        """Tokens in one verify forward: the method's draft and the lookup nodes."""
        return self.slots + self.lookup_slots

    @property
    def verify_depth(self) -> int:
        """The most draft tokens one round can accept."""
        return self.depth + self.lookup_slots

    @property
    def cache_slack(self) -> int:
        """Cache slots a round may touch past the committed length (verify tree, overshoot, drafter scratch)."""
        return max(self.verify_slots + self.verify_depth + 1, methods.REGISTRY[self.method].scratch(self))


# The preset a request gets when it sets none of its fields, by the platform it runs on (`spec_defaults`);
# explicit options win, then `tuned=True`'s file, then this table, then `SpecConfig`'s own fields.
# cpu: `hsd tune` on 2 Zen 4 cores with the CPU kernels (BENCHMARKS.md, "hsd tune on this CPU"):
#   3/2/2 with 4 prompt-lookup nodes 1.31x ar, the 8/4/3 tree 0.95x (verify rows cost there); 12-07's
#   tune chose 3/3/1 + 4 on math prompts, which lost MT-bench (1.15x vs 1.35x): 3/2/2 + 4 kept;
# gpu: SpecConfig's 8/4/3 (the H200 pack: verify 2.0 ms at 1 row, 2.7 ms at 64); tpu: the same, unmeasured.
BACKEND_DEFAULTS = {
    "cpu": {"tree_nodes": 3, "tree_depth": 2, "tree_top_k": 2, "lookup_slots": 4},
    "gpu": {},
    "tpu": {},
}


def spec_defaults(method: str, platform: str, given=()) -> dict:
    """The options `platform`'s row of `BACKEND_DEFAULTS` adds to the `given` ones for `method`. A
    row is one preset (a tree with its lookup nodes): a request that sets any of its fields takes
    none of it (its other fields keep SpecConfig's), and a chain method (sd, lookup) none of it."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if platform not in BACKEND_DEFAULTS:
        raise ConfigError(f"no speculative defaults for platform {platform!r}; known: {tuple(BACKEND_DEFAULTS)}")
    row = BACKEND_DEFAULTS[platform]
    if methods.REGISTRY[method].drafts != "tree" or set(given) & set(row):
        return {}
    return dict(row)


class SpecStats(NamedTuple):
    rounds: jax.Array            # [B] verify forwards
    accepted_hist: jax.Array     # [B, D+1] rounds by number of accepted draft tokens
    drafter_steps: jax.Array     # [B] sequential drafter forwards (ingest calls and chain/tree steps)
    lookup_rounds: jax.Array     # [B] rounds that verified the prompt-lookup nodes (`lookup_slots`)
    verified_slots: jax.Array    # [B] verify rows computed, root included (fewer than rounds x slots where skipped)


class SpecOutput(NamedTuple):
    tokens: jax.Array
    num_tokens: jax.Array
    stats: SpecStats
    state: Any = None   # the loop's final cache, method state and key (as `DecodeOutput.state`)


class SpecLoop(NamedTuple):
    """The decode loop's carry."""

    tcache: KVCache     # the target's KV cache (committed prefix + scratch)
    dstate: tuple       # the method's own state (its module's `State`)
    root: jax.Array     # [B] the newest committed token, not yet in the target cache
    tokens: jax.Array   # [B, capacity + D + 1] committed new tokens, -1 beyond count
    count: jax.Array    # [B]
    done: jax.Array     # [B]
    key: jax.Array
    stats: SpecStats


def verify_tree(tparams, tcfg: ModelConfig, cache: KVCache, tree: Tree, active=None) -> llama.ForwardOutput:
    """One target forward over all tree slots with tree attention (features [B, T, d], cache);
    `active` [B, T]: the slots that need outputs (`llama.forward`)."""
    pos = tree_lib.positions(tree, cache.lengths)
    return llama.forward(tparams, tcfg, tree.tokens, pos, cache, tree.parents, active)


def target_verdict(tparams, tcfg: ModelConfig, tree: Tree, features, key, sampling: SamplingConfig,
                   chain=None, screen: llama.HeadScreen | None = None) -> Accepted:
    """The target's head on every verified slot decides: at T = 0 through its argmax (certified
    from the bf16 `screen` where given, `llama.serving_argmax`), else the lossless rules on its f32
    logits."""
    if sampling.greedy:
        return accept_greedy(tree, llama.serving_argmax(tparams, tcfg, features, screen))
    return accept(tree, llama.serving_logits(tparams, tcfg, features), key, sampling, chain)


def commit(cache: KVCache, acc: Accepted, live) -> KVCache:
    """Move the accepted path's K/V (root included) right after the committed prefix."""
    return compact(cache, acc.path, jnp.where(live, acc.num_accepted + 1, 0))


def _round(tparams, tcfg, dparams, dcfg, d2t, spec: SpecConfig, sampling, prompt_tokens, prompt_lens,
           capacity: int) -> methods.Round:
    view = None
    if methods.REGISTRY[spec.method].drafter.has_draft_vocab:
        view = drafter.target_view(tparams, tcfg, d2t, dparams.get("packed_kernels", {}).get("draft_head"))
    return methods.Round(tparams, tcfg, dparams, dcfg, d2t, spec, sampling, prompt_tokens, prompt_lens, capacity, view)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "spec", "sampling", "capacity"))
def spec_prefill(tparams, dparams, d2t, prompt_tokens, prompt_lens, key, *, tcfg: ModelConfig, dcfg,
                 spec: SpecConfig, sampling: SamplingConfig, capacity: int) -> Prefilled:
    """Speculative decoding's prefill: the target over the prompts, the first token, and the
    method's `init` (its drafter over the prompts); one program per padded prompt length."""
    out, root, key = _prefill_root(tparams, tcfg, prompt_tokens, prompt_lens, key, sampling, capacity)
    rnd = _round(tparams, tcfg, dparams, dcfg, d2t, spec, sampling, prompt_tokens, prompt_lens, capacity)
    dstate = methods.REGISTRY[spec.method].init(rnd, out, root)
    return Prefilled(out.cache, dstate, root, pad_to_capacity(prompt_tokens, capacity),
                     prompt_lens.astype(jnp.int32), key)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "spec", "sampling", "rows"), donate_argnames=("pre",))
def spec_decode(tparams, dparams, d2t, pre: Prefilled, max_new_tokens, *, tcfg: ModelConfig, dcfg,
                spec: SpecConfig, sampling: SamplingConfig, rows: int = 0) -> SpecOutput:
    """Speculative decoding with `spec.method` from `spec_prefill`'s output, all rounds in one
    `lax.while_loop`: the method drafts, the target verifies the tree in one forward, the accepted
    path is committed, and the method updates its state. `max_new_tokens` is traced (one program
    for every bound and prompt length); tokens come back [B, capacity], -1 from num_tokens on.
    `rows` > 0 (`exact`): every verify forward at that many rows, the tree padded with unreachable,
    inactive slots (`tree.pad_tree`), as `ar_decode(rows=...)` pads its steps. `pre` is donated, as
    `ar_decode`'s: its cache and the method's state come back in `state`."""
    method = methods.REGISTRY[spec.method]
    if rows and rows < spec.verify_slots:
        raise ConfigError(f"rows {rows} is narrower than the {spec.verify_slots}-slot verify tree")
    b, capacity = pre.cache.batch_size, pre.cache.capacity
    max_new_tokens = jnp.asarray(max_new_tokens, jnp.int32)
    depth = spec.verify_depth
    rnd = _round(tparams, tcfg, dparams, dcfg, d2t, spec, sampling, pre.prompt, pre.prompt_lens, capacity)
    screens = {n: llama.head_screen(tparams, tcfg, b * n) if spec.head_screen and sampling.greedy else None
               for n in {spec.slots, spec.verify_slots} | ({rows} if rows else set())}
    root = pre.root
    tokens = jnp.full((b, capacity + depth + 1), -1, jnp.int32).at[:, 0].set(root)
    count = jnp.ones((b,), jnp.int32)
    done = is_eos(root, tcfg.eos_token_ids) | (max_new_tokens <= 1)
    zeros = jnp.zeros((b,), jnp.int32)
    stats = SpecStats(zeros, jnp.zeros((b, depth + 1), jnp.int32), zeros, zeros, zeros)

    def body(s: SpecLoop) -> SpecLoop:
        live = ~s.done
        key, k_draft, k_acc = jax.random.split(s.key, 3)
        history = methods.History(s.tokens, s.count)
        draft = method.draft(rnd, s.dstate, s.root, history, k_draft)
        tree, active, wide = draft.tree, None, False
        if spec.lookup_slots:   # the union (every round, or when some live sequence's lookup match is long enough)
            tree, matched = methods.lookup.attach(rnd, draft.tree, history, spec.lookup_slots)
            wide = jnp.any(live & (matched >= spec.lookup_min_match))
            if spec.lookup_min_match:   # else the method's tree, its lookup slots unreachable and skipped
                own = tree_lib.pad_tree(draft.tree, spec.verify_slots, depth)
                tree = jax.tree.map(lambda u, o: jnp.where(wide, u, o), tree, own)
                width = jnp.where(wide, spec.verify_slots, spec.slots)
                active = jnp.broadcast_to(jnp.arange(spec.verify_slots) < width, tree.tokens.shape)
        if spec.min_draft_prob:   # unlikely drafts leave the tree, their rows skipped
            tree, keep = tree_lib.prune_tree(tree, math.log(spec.min_draft_prob))
            active = keep if active is None else active & keep
        if rows > tree.num_slots:   # exact: the verify at the common row width, the padding inactive
            own = jnp.arange(rows) < tree.num_slots
            active = own if active is None else jnp.pad(active, ((0, 0), (0, rows - tree.num_slots)))
            tree = tree_lib.pad_tree(tree, rows, depth)
            active = jnp.broadcast_to(active, tree.tokens.shape)
        vout = verify_tree(tparams, tcfg, s.tcache, tree, active)
        acc = target_verdict(tparams, tcfg, tree, vout.features, k_acc, sampling, draft.chain, screens[tree.num_slots])
        computed = tree.num_slots if active is None else active.sum(1, dtype=jnp.int32)
        draft = draft._replace(tree=tree)   # slots of the own tree keep their index in the union
        tcache = commit(vout.cache, acc, live)
        dstate, more = method.update(rnd, draft.state, draft, acc, vout, live)
        new = emitted_tokens(draft.tree, acc)
        i = jnp.arange(depth + 1)[None, :]
        n = acc.num_accepted + 1
        eos_at = jnp.where(is_eos(new, tcfg.eos_token_ids) & (i < n[:, None]), i, depth + 1).min(1)
        n = jnp.minimum(n, eos_at + 1)
        slots = jnp.where(live[:, None] & (i < n[:, None]), s.count[:, None] + i, s.tokens.shape[1])
        tokens = s.tokens.at[jnp.arange(b)[:, None], slots].set(new, mode="drop")
        count = s.count + jnp.where(live, n, 0)
        done = s.done | (eos_at <= depth) | (count >= max_new_tokens)
        st = s.stats
        stats = SpecStats(st.rounds + live, st.accepted_hist.at[jnp.arange(b), acc.num_accepted].add(live),
                          st.drafter_steps + jnp.where(live, draft.steps + more, 0), st.lookup_rounds + (live & wide),
                          st.verified_slots + jnp.where(live, computed, 0))
        return SpecLoop(tcache, dstate, jnp.where(live, acc.token, s.root), tokens, count, done, key, stats)

    s = jax.lax.while_loop(lambda s: jnp.any(~s.done), body,
                           SpecLoop(pre.cache, pre.dstate, root, tokens, count, done, pre.key, stats))
    count = jnp.minimum(s.count, max_new_tokens)
    kept = jnp.arange(capacity)[None, :] < count[:, None]
    return SpecOutput(jnp.where(kept, s.tokens[:, :capacity], -1), count, s.stats, (s.tcache, s.dstate, s.key))
