"""The interface every decoding method implements, and the records the round passes around.

A method drafts, the engine verifies and commits, the method updates its own state. Each
method is one module with three pure functions over its own state pytree (a NamedTuple):

    init(rnd, prefill_out, root) -> state            after the target's prefill
    draft(rnd, state, root, history, key) -> Draft   a tree (or chain) to verify
    update(rnd, state, draft, accepted, verify_out, live) -> (state, drafter steps [B])

plus a `DrafterKind` that builds, restores and checks its drafter. `hsd_jax.methods.REGISTRY`
lists them; the loop, `load_drafter`, `generate`, the CLI, `hsd bench` and `hsd tune` read it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax

from hsd_jax.tree import Tree


@dataclasses.dataclass(frozen=True)
class Round:
    """What a round reads and never changes: weights, static configs and the prompts.
    Closed over by the decode loop, never carried."""

    tparams: Any
    tcfg: Any               # target ModelConfig
    dparams: Any
    dcfg: Any               # the drafter's config
    d2t: jax.Array          # draft id -> target id (a dummy for drafters without a draft vocabulary)
    spec: Any               # engine.SpecConfig
    sampling: Any           # SamplingConfig
    prompt_tokens: jax.Array  # [B, T] right-padded: T the prompt bucket in `init`, the cache capacity in rounds
    prompt_lens: jax.Array    # [B]
    capacity: int
    view: Any = None        # feature drafters: the frozen target pieces they read (drafter.TargetView)

    @property
    def batch(self) -> int:
        return self.prompt_tokens.shape[0]


class History(NamedTuple):
    """The tokens committed so far: tokens [B, N] (the root at count - 1) and count [B]."""

    tokens: jax.Array
    count: jax.Array


class Draft(NamedTuple):
    """A method's proposal for one round."""

    tree: Tree
    state: Any                  # the method's state after drafting
    steps: jax.Array            # [B] sequential drafter forwards spent drafting
    chain: Any = None           # (tokens [B, G], q [B, G, V]) for a sampled chain (lossless SD acceptance)


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """How a method's drafter is built, restored and checked.

    config(raw) -> config from drafter.json's dict; random(target, seed, **overrides) ->
    (params, config, d2t) for tests; finish(params, config, d2t, target) -> (params, config, d2t)
    after restoring and casting to the target's dtype (shared weights, dtype fixes, checks).
    built_in: the drafter needs no training (its defaults are the drafter): `load_drafter` builds
    it when no path is given, and `generate` when no drafter is passed.
    read(path, target) -> (params, config, d2t), or None: a directory in a format published by
    others (e.g. EAGLE-3 checkpoints), read before `load_drafter` looks for drafter.json."""

    config: Callable
    random: Callable
    finish: Callable
    has_draft_vocab: bool = True
    built_in: bool = False
    read: Callable = lambda path, target: None


@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding method: its round functions, its drafter, and what it drafts.

    drafts: "tree" (a top-k tree shaped by tree_nodes / tree_depth / tree_top_k) or "chain"
    (gamma sampled tokens). scratch(spec): drafter cache slots a round writes past the committed
    length beyond the verify tree's. check(drafter, spec): refuse a drafter/spec this method
    cannot serve, with a message for the user."""

    name: str
    summary: str
    init: Callable
    draft: Callable
    update: Callable
    drafter: DrafterKind
    drafts: str = "tree"
    reuse: bool = False
    scratch: Callable = lambda spec: 0
    check: Callable = lambda drafter, spec: None

    @property
    def options(self) -> frozenset:
        """The speculative options (SpecConfig fields) this method reads."""
        tree = {"tree_nodes", "tree_depth", "tree_top_k", "lookup_slots", "lookup_min_match", "min_draft_prob"}
        shape = tree if self.drafts == "tree" else {"gamma"}
        return frozenset(shape | ({"reuse"} if self.reuse else set()))
