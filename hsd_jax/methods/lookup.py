"""Prompt lookup: draft the continuation of the most recent earlier occurrence of the last n
committed tokens (n from `max_ngram` down to `min_ngram`) in the prompt plus the text generated
so far. Free: no drafter forward, no state; strong where outputs copy their inputs
(summarisation, RAG, code edits), weak in open chat.

Static shapes: the search is one vectorised compare of the fixed-size token buffer against its
own suffix per n. Without a match the chain repeats the root: it is verified like any draft
(a wasted slot, never a wrong token).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from hsd_jax.config import _require, from_json
from hsd_jax.methods.base import Draft, DrafterKind, Method
from hsd_jax.tree import Tree, attach_chain, chain_tree


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    """n-gram lengths tried for the match, longest first. Hashable: a static jit argument."""

    max_ngram: int = 3
    min_ngram: int = 1
    kind: str = "lookup"

    def __post_init__(self):
        _require(self.kind == "lookup", f"a lookup drafter's kind is 'lookup', got {self.kind!r}")
        _require(1 <= self.min_ngram <= self.max_ngram,
                 f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")


class State(NamedTuple):
    pass


def committed_sequence(prompt_tokens, prompt_lens, tokens, count):
    """[B, T + N] the prompt followed by the generated tokens, and its length [B] (root = last)."""
    b, t = prompt_tokens.shape
    j = jnp.arange(t + tokens.shape[1])[None, :]
    gen = jnp.take_along_axis(tokens, jnp.clip(j - prompt_lens[:, None], 0, tokens.shape[1] - 1), 1)
    seq = jnp.where(j < prompt_lens[:, None], jnp.take_along_axis(prompt_tokens, jnp.minimum(j, t - 1), 1), gen)
    return seq, prompt_lens + count


def lookup_chain(seq, length, k: int, max_ngram: int, min_ngram: int):
    """The k tokens after the most recent earlier match of the last n tokens, n = max..min, how
    many of them are real (continuations reach at most the last committed token), and the match's
    length n [B] (0: none)."""
    b, cap = seq.shape
    e = jnp.arange(cap)[None, :]                      # candidate match end
    best = jnp.full((b,), -1, jnp.int32)
    matched = jnp.zeros((b,), jnp.int32)
    for n in range(max_ngram, min_ngram - 1, -1):
        ok = (e >= n - 1) & (e < length[:, None] - 1)
        for i in range(n):
            suffix = jnp.take_along_axis(seq, jnp.maximum(length - 1 - i, 0)[:, None], 1)
            ok = ok & (jnp.take_along_axis(seq, jnp.maximum(e - i, 0), 1) == suffix) & (length[:, None] > n)
        last = jnp.max(jnp.where(ok, e, -1), 1).astype(jnp.int32)
        matched = jnp.where((best < 0) & (last >= 0), n, matched)
        best = jnp.where(best >= 0, best, last)
    pos = best[:, None] + 1 + jnp.arange(k)[None, :]
    real = (best[:, None] >= 0) & (pos < length[:, None])
    root = jnp.take_along_axis(seq, (length - 1)[:, None], 1)
    toks = jnp.where(real, jnp.take_along_axis(seq, jnp.clip(pos, 0, cap - 1), 1), root)
    return toks.astype(jnp.int32), real.sum(1), matched


def init(rnd, prefill_out, root) -> State:
    return State()


def draft(rnd, state: State, root, history, key) -> Draft:
    seq, length = committed_sequence(rnd.prompt_tokens, rnd.prompt_lens.astype(jnp.int32), history.tokens,
                                     history.count)
    toks, _, _ = lookup_chain(seq, length, rnd.spec.gamma, rnd.dcfg.max_ngram, rnd.dcfg.min_ngram)
    return Draft(chain_tree(toks, root), state, jnp.zeros((rnd.batch,), jnp.int32))


def attach(rnd, tree: Tree, history, m: int) -> tuple[Tree, jnp.ndarray]:
    """Another method's tree with `m` lookup nodes merged in (`SpecConfig.lookup_slots`): the
    lookup continuation with the default n-grams, hung below the tree's node that spells its
    prefix, and the match's length [B] that proposed it (0: none). Deterministic drafts, so the
    tree acceptance rule stays exactly lossless."""
    seq, length = committed_sequence(rnd.prompt_tokens, rnd.prompt_lens.astype(jnp.int32), history.tokens,
                                     history.count)
    cfg = LookupConfig()
    toks, _, matched = lookup_chain(seq, length, tree.max_depth + m, cfg.max_ngram, cfg.min_ngram)
    return attach_chain(tree, toks, m), matched


def update(rnd, state: State, drft: Draft, acc, vout, live):
    return state, jnp.zeros((rnd.batch,), jnp.int32)


def _random(target, seed: int, **overrides):
    return {}, LookupConfig(**overrides), None


def _finish(params, cfg, d2t, target):
    return params, cfg, None


METHOD = Method("lookup", "prompt lookup: the continuation of the last n-gram's most recent earlier occurrence "
                "(no drafter; chain length gamma)", init, draft, update,
                DrafterKind(lambda raw: from_json(LookupConfig, raw), _random, _finish, has_draft_vocab=False,
                            built_in=True), drafts="chain")
