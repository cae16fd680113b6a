"""The free n-gram (bigram) drafter: the floor every trained drafter must beat (HSD.md baselines).

A table from each token to its `top_k` most frequent next tokens in the training data,
with their log conditional frequencies; tokens never seen in the data fall back to the
most frequent tokens overall. Drafting is a table lookup per tree node: no forward pass,
no cache, no training. The engine grows the same dynamic tree from it as for HSD/EAGLE.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hsd_jax.config import _require


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """A bigram table over the target's vocabulary. Hashable: a static jit argument."""

    vocab_size: int
    top_k: int = 8
    kind: str = "ngram"

    def __post_init__(self):
        _require(self.kind == "ngram", f"an n-gram drafter's kind is 'ngram', got {self.kind!r}")
        _require(self.vocab_size > 0, f"vocab_size must be positive, got {self.vocab_size}")
        _require(1 <= self.top_k <= self.vocab_size, f"top_k must be in [1, vocab_size], got {self.top_k}")

    def check_target(self, target_cfg) -> None:
        _require(self.vocab_size == target_cfg.vocab_size,
                 f"n-gram table vocab {self.vocab_size} does not match the target's {target_cfg.vocab_size}")


def response_bigrams(seqs, prompt_lens) -> np.ndarray:
    """[N, 2] (previous, next) token pairs whose next token is a response token."""
    pairs = [np.stack([s[max(p - 1, 0):-1], s[max(p, 1):]], 1) for s, p in zip(seqs, prompt_lens) if len(s) > max(p, 1)]
    return np.concatenate(pairs) if pairs else np.zeros((0, 2), np.int64)


def bigram_table(seqs, prompt_lens, cfg: NgramConfig) -> dict:
    """{"next_tokens" [V, K] int32, "next_logp" [V, K] f32} from the response bigrams of `seqs`
    (a response's first token follows the prompt's last). Ties break by lower token id."""
    v, k = cfg.vocab_size, cfg.top_k
    pairs = response_bigrams(seqs, prompt_lens)
    _require(len(pairs) > 0 and pairs.min() >= 0 and pairs.max() < v, f"training tokens must be ids in [0, {v})")
    uniq, counts = np.unique(pairs[:, 0].astype(np.int64) * v + pairs[:, 1], return_counts=True)
    prev, nxt = uniq // v, uniq % v
    unigram = np.bincount(pairs[:, 1], minlength=v)
    fallback = np.argsort(-unigram, kind="stable")[:k]
    tokens = np.tile(fallback.astype(np.int32), (v, 1))
    logp = np.tile(np.log(np.maximum(unigram[fallback], 1) / max(len(pairs), 1)).astype(np.float32), (v, 1)) - 20.0
    order = np.lexsort((nxt, -counts, prev))  # by prev, then count descending, then id
    prev, nxt, counts = prev[order], nxt[order], counts[order]
    starts = np.searchsorted(prev, np.arange(v))
    rank = np.arange(len(prev)) - starts[prev]
    totals = np.bincount(prev, weights=counts, minlength=v)
    keep = rank < k
    tokens[prev[keep], rank[keep]] = nxt[keep]
    logp[prev[keep], rank[keep]] = np.log(counts[keep] / totals[prev[keep]])
    return {"next_tokens": tokens, "next_logp": logp}


def children(params: dict, tokens: jnp.ndarray, k: int):
    """Top-k next tokens and their log-probs for each token: [..., k] each."""
    return params["next_tokens"][tokens, :k], params["next_logp"][tokens, :k].astype(jnp.float32)
