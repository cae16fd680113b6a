"""The n-gram floor: every tree node's children are its token's most frequent successors in
the training data (a bigram table). No forward pass, no cache, no state."""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from hsd_jax.config import InputError, from_json
from hsd_jax.loading.errors import ModelLoadError
from hsd_jax.methods.base import Draft, DrafterKind, Method
from hsd_jax.models import ngram
from hsd_jax.models.ngram import NgramConfig
from hsd_jax.tree import grow_tree


class State(NamedTuple):
    pass


def init(rnd, prefill_out, root) -> State:
    return State()


def draft(rnd, state: State, root, history, key) -> Draft:
    k, table = rnd.spec.tree_top_k, rnd.dparams
    tree = grow_tree(ngram.children(table, root, k), lambda j, ftok, _: ngram.children(table, ftok, k), root, rnd.spec)
    return Draft(tree, state, jnp.zeros((rnd.batch,), jnp.int32))


def update(rnd, state: State, drft: Draft, acc, vout, live):
    return state, jnp.zeros((rnd.batch,), jnp.int32)


def _random(target, seed: int, **overrides):
    cfg = NgramConfig(**dict(dict(vocab_size=target.config.vocab_size), **overrides))
    rng = np.random.default_rng(seed)
    params = {"next_tokens": rng.integers(0, cfg.vocab_size, (cfg.vocab_size, cfg.top_k), dtype=np.int32),
              "next_logp": np.tile(-np.arange(1, cfg.top_k + 1, dtype=np.float32), (cfg.vocab_size, 1))}
    return params, cfg, None


def _finish(params, cfg: NgramConfig, d2t, target):
    cfg.check_target(target.config)
    if params["next_tokens"].shape != (cfg.vocab_size, cfg.top_k):
        raise ModelLoadError(f"n-gram table must be [{cfg.vocab_size}, {cfg.top_k}], got {params['next_tokens'].shape}")
    return dict(params, next_logp=jnp.asarray(params["next_logp"], jnp.float32)), cfg, None  # scores stay f32


def _check(d, spec):
    if spec.tree_top_k > d.config.top_k:
        raise InputError(f"tree_top_k {spec.tree_top_k} exceeds the n-gram table's {d.config.top_k} "
                         "successors per token")


METHOD = Method("ngram", "the free bigram-table floor (hsd data ngram builds the table)",
                init, draft, update, DrafterKind(lambda raw: from_json(NgramConfig, raw), _random, _finish,
                                                 has_draft_vocab=False), check=_check)
