"""Static-shape draft trees for speculative decoding, jittable with static sizes.

Conventions (the engine relies on these):

* A tree has ``T`` slots (``T - 1`` draft nodes plus the root). Slot 0 is the
  root: the last committed token x_p, not yet in the target KV cache, with
  ``parents = -1``, ``depth = 0`` and ``score = 0``.
* Draft nodes are slots ``1..T-1``; a parent always precedes its children
  (``parents[i] < i``). Builders order slots by depth, then by score descending
  within a depth (templates: by path within a depth, so siblings by rank).
* Every array has a leading batch dim ``B``: each sequence owns its tree.
* ``D`` is the static maximum depth: ``paths`` has ``D + 1`` columns.

Structure (mask, depth, paths, child links) is derived from ``parents`` with
dense compares and small matmuls instead of data-dependent gathers, so it maps
to accelerator-friendly ops: the ancestor mask is the transitive closure of
``I + onehot(parent)`` by repeated boolean squaring (``ceil(log2 D)`` matmuls).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.tree_attention import ancestor_mask as kernel_ancestor_mask

_HI = jax.lax.Precision.HIGHEST


@struct.dataclass
class Tree:
    """A batch of draft trees (see module docstring for the slot conventions).

    tokens:       int32 [B, T]; slot 0 holds the root token.
    parents:      int32 [B, T]; -1 for the root.
    depth:        int32 [B, T]; root 0.
    scores:       float32 [B, T]; cumulative draft log-prob, root 0.
    mask:         bool [B, T, T]; mask[b, i, j] iff j is an ancestor of i or j == i.
    paths:        int32 [B, T, D+1]; root-to-node slots, padded with -1.
    first_child:  int32 [B, T]; lowest-slot child (best-scoring), -1 if none.
    next_sibling: int32 [B, T]; next child of the same parent in slot order, -1 if none.
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    scores: jax.Array
    mask: jax.Array
    paths: jax.Array
    first_child: jax.Array
    next_sibling: jax.Array

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[-1] - 1


def positions(tree: Tree, base: jax.Array) -> jax.Array:
    """RoPE position ids [B, T]: ``base[:, None] + depth`` (base = committed length)."""
    return (jnp.asarray(base, jnp.int32)[:, None] + tree.depth).astype(jnp.int32)


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """Ancestor-or-self mask bool [B, T, T] (the one tree attention uses, `pallas_kernels`),
    with ``ceil(log2(max_depth))`` squarings for trees of depth <= max_depth."""
    return kernel_ancestor_mask(parents, max_depth)


def _paths_from_mask(mask: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
    """paths[b, i, k] = the ancestor-or-self of i at depth k, else -1 (two matmuls)."""
    num_slots = mask.shape[-1]
    at_depth = (depth[..., :, None] == jnp.arange(max_depth + 1)).astype(jnp.float32)
    slot_ids = jnp.arange(num_slots, dtype=jnp.float32)[:, None]
    m = mask.astype(jnp.float32)
    has = jnp.matmul(m, at_depth, precision=_HI)
    which = jnp.matmul(m, at_depth * slot_ids, precision=_HI)
    return jnp.where(has > 0.5, jnp.round(which).astype(jnp.int32), -1)


def _min_slot(cond: jax.Array) -> jax.Array:
    """Lowest j with cond[..., j] true, else -1."""
    num_slots = cond.shape[-1]
    first = jnp.min(jnp.where(cond, jnp.arange(num_slots, dtype=jnp.int32), num_slots), axis=-1)
    return jnp.where(first == num_slots, -1, first).astype(jnp.int32)


def child_links(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Left-child / right-sibling encoding (first_child, next_sibling), both int32 [B, T]."""
    num_slots = parents.shape[-1]
    idx = jnp.arange(num_slots, dtype=jnp.int32)
    is_child = parents[..., None, :] == idx[:, None]
    same_parent = (parents[..., :, None] == parents[..., None, :]) & (parents[..., :, None] >= 0)
    later = idx[None, :] > idx[:, None]
    return _min_slot(is_child), _min_slot(same_parent & later)


def build_tree(tokens: jax.Array, parents: jax.Array, scores: jax.Array, max_depth: int) -> Tree:
    """Assemble a Tree from slot-space ``tokens``, ``parents`` and ``scores`` ([B, T]).

    Requires parents[:, 0] == -1, parents[:, i] < i and tree depth <= max_depth.
    """
    parents = parents.astype(jnp.int32)
    mask = ancestor_mask(parents, max_depth)
    depth = (jnp.sum(mask, axis=-1) - 1).astype(jnp.int32)
    first_child, next_sibling = child_links(parents)
    return Tree(
        tokens=tokens.astype(jnp.int32),
        parents=parents,
        depth=depth,
        scores=scores.astype(jnp.float32),
        mask=mask,
        paths=_paths_from_mask(mask, depth, max_depth),
        first_child=first_child,
        next_sibling=next_sibling,
    )


# ---------------------------------------------------------------------------
# Chain
# ---------------------------------------------------------------------------


def chain_tree(draft_tokens: jax.Array, root_tokens: jax.Array, draft_scores: jax.Array | None = None) -> Tree:
    """A chain root -> d_1 -> ... -> d_D (T = D + 1).

    draft_scores, if given, are cumulative draft log-probs [B, D]; default 0.
    """
    batch, depth = draft_tokens.shape
    if draft_scores is None:
        draft_scores = jnp.zeros((batch, depth), jnp.float32)
    tokens = jnp.concatenate([jnp.asarray(root_tokens, jnp.int32)[:, None], draft_tokens.astype(jnp.int32)], axis=1)
    scores = jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), draft_scores.astype(jnp.float32)], axis=1)
    parents = jnp.broadcast_to(jnp.arange(-1, depth, dtype=jnp.int32), (batch, depth + 1))
    return build_tree(tokens, parents, scores, depth)


# ---------------------------------------------------------------------------
# Dynamic tree (EAGLE-2 style)
# ---------------------------------------------------------------------------


def expand_frontier(cand_tokens: jax.Array, cand_scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k of one depth's candidates by cumulative score (ties: lower index first).

    Returns (frontier_idx, frontier_tokens, frontier_scores), each [B, k];
    frontier_idx indexes the depth's candidate array.
    """
    if k > cand_scores.shape[-1]:
        raise ValueError(f"expand_frontier: k={k} exceeds the {cand_scores.shape[-1]} candidates")
    scores, idx = jax.lax.top_k(cand_scores, k)
    return idx.astype(jnp.int32), jnp.take_along_axis(cand_tokens, idx, axis=-1), scores


def child_candidates(
    frontier_scores: jax.Array,
    child_logp: jax.Array,
    child_tokens: jax.Array,
    frontier_idx: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Next depth's candidates from the frontier's top-k children.

    frontier_scores [B, K]; child_logp, child_tokens [B, K, K2] (children of
    each frontier node). Returns (cand_tokens, cand_scores, cand_parent), each
    [B, K*K2], flattened frontier-major; cand_scores = parent score + child
    log-prob. cand_parent is the frontier position of the parent, or, when
    frontier_idx is given, ``frontier_idx`` at that position (an index into the
    previous depth's candidate array, as ``dynamic_tree`` expects).
    """
    batch, k, k2 = child_logp.shape
    scores = (frontier_scores[:, :, None] + child_logp).reshape(batch, k * k2)
    parent = jnp.broadcast_to(jnp.repeat(jnp.arange(k, dtype=jnp.int32), k2), (batch, k * k2))
    if frontier_idx is not None:
        parent = jnp.take_along_axis(frontier_idx.astype(jnp.int32), parent, axis=-1)
    return child_tokens.reshape(batch, k * k2).astype(jnp.int32), scores.astype(jnp.float32), parent


def _check_depth_inputs(depth_tokens, depth_scores, depth_parents, num_nodes) -> None:
    """Static shape validation for dynamic_tree (raises ValueError at trace time)."""
    n_depths = len(depth_tokens)
    if n_depths == 0 or len(depth_scores) != n_depths or len(depth_parents) != n_depths:
        raise ValueError("dynamic_tree: need the same non-zero number of depths for tokens, scores and parents")
    batch = depth_tokens[0].shape[0]
    for j, (t, s, p) in enumerate(zip(depth_tokens, depth_scores, depth_parents)):
        if t.ndim != 2 or t.shape != s.shape or t.shape != p.shape or t.shape[0] != batch:
            raise ValueError(
                f"dynamic_tree: depth {j + 1} tokens/scores/parents must share shape [B={batch}, C], "
                f"got {t.shape}, {s.shape}, {p.shape}"
            )
    total = sum(t.shape[1] for t in depth_tokens)
    if num_nodes < 1:
        raise ValueError(f"dynamic_tree: num_nodes must be >= 1 (the root), got {num_nodes}")
    if num_nodes - 1 > total:
        raise ValueError(
            f"dynamic_tree: num_nodes - 1 = {num_nodes - 1} draft nodes requested but only {total} candidates"
        )


def _path_min_scores(depth_scores: Sequence[jax.Array], depth_parents: Sequence[jax.Array]) -> list[jax.Array]:
    """Running minimum of scores along each candidate's path (equals the score when log-probs <= 0)."""
    out = [depth_scores[0].astype(jnp.float32)]
    for s, p in zip(depth_scores[1:], depth_parents[1:]):
        parent_score = jnp.take_along_axis(out[-1], jnp.clip(p, 0, out[-1].shape[-1] - 1), axis=-1)
        out.append(jnp.minimum(s.astype(jnp.float32), parent_score))
    return out


def dynamic_tree(
    depth_tokens: Sequence[jax.Array],
    depth_scores: Sequence[jax.Array],
    depth_parents: Sequence[jax.Array],
    root_tokens: jax.Array,
    num_nodes: int,
) -> Tree:
    """EAGLE-2 dynamic tree: keep the best ``num_nodes - 1`` candidates over all depths.

    Inputs are static-length lists over depths 1..D of [B, C_j] arrays: tokens,
    cumulative scores, and the parent's index into depth j-1's candidate array
    (ignored at depth 1, whose parent is the root).

    Selection is a global top-(T-1) on the key ``min(score along the path)``,
    which equals the score when child log-probs are <= 0. The key never rises
    from parent to child, and ``lax.top_k`` breaks ties by lower flat index;
    candidates are flattened depth-major, so a parent precedes its descendants
    and wins every tie: the kept set is always ancestor-closed. Kept nodes are
    placed in slots by depth, then key descending (ties: lower flat index), and
    their ``scores`` are the key.
    """
    _check_depth_inputs(depth_tokens, depth_scores, depth_parents, num_nodes)
    n_depths = len(depth_tokens)
    batch = depth_tokens[0].shape[0]
    sizes = [t.shape[1] for t in depth_tokens]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)

    keys = jnp.concatenate(_path_min_scores(depth_scores, depth_parents), axis=1)
    flat_tokens = jnp.concatenate([t.astype(jnp.int32) for t in depth_tokens], axis=1)
    flat_parent = jnp.concatenate(
        [jnp.full((batch, sizes[0]), -1, jnp.int32)]
        + [depth_parents[j].astype(jnp.int32) + offsets[j - 1] for j in range(1, n_depths)],
        axis=1,
    )
    flat_depth = jnp.asarray(np.repeat(np.arange(1, n_depths + 1, dtype=np.int32), sizes))

    n_draft = num_nodes - 1
    sel_scores, sel = jax.lax.top_k(keys, n_draft)
    sel = sel.astype(jnp.int32)
    order = jnp.argsort(flat_depth[sel], axis=-1, stable=True)
    sel = jnp.take_along_axis(sel, order, axis=-1)
    sel_scores = jnp.take_along_axis(sel_scores, order, axis=-1)

    parent_flat = jnp.take_along_axis(flat_parent, sel, axis=-1)
    match = parent_flat[:, :, None] == sel[:, None, :]
    parent_slot = jnp.sum(jnp.where(match, jnp.arange(1, n_draft + 1, dtype=jnp.int32), 0), axis=-1)

    tokens = jnp.concatenate(
        [jnp.asarray(root_tokens, jnp.int32)[:, None], jnp.take_along_axis(flat_tokens, sel, axis=-1)], axis=1
    )
    parents = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parent_slot], axis=1)
    scores = jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), sel_scores], axis=1)
    return build_tree(tokens, parents, scores, n_depths)


def topk_draft(logits: jax.Array, d2t: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k draft tokens (target ids via the draft-vocab map d2t) and their log-probs from
    draft-vocab logits [..., V_d]."""
    logp = jax.nn.log_softmax(logits, -1)
    vals, idx = jax.lax.top_k(logp, k)
    return jnp.take(d2t, idx), vals


def grow_tree(first, children, root_tokens: jax.Array, spec, root_context: jax.Array | None = None) -> Tree:
    """A dynamic tree from top-k drafts: `first` = (tokens, log-probs) [B, k] at depth 1 and
    `children(j, frontier_tokens, frontier_context)` -> the same [B, F, k] for the children at
    depth j+1 (spec: tree_depth, tree_top_k, slots). With `root_context` [B, n] (the committed
    tokens before the root, most recent first), frontier_context [B, F, n] holds each frontier
    node's path tokens before it; otherwise it is None."""
    k = spec.tree_top_k
    depth_tokens, depth_scores, depth_parents = [first[0]], [first[1]], [jnp.full_like(first[0], -1)]
    ctx = None
    if root_context is not None:  # the path before each depth-1 candidate: root, then the root's context
        path = jnp.concatenate([root_tokens[:, None], root_context[:, :-1]], 1)
        ctx = jnp.broadcast_to(path[:, None], first[0].shape + path.shape[-1:])
    for j in range(1, spec.tree_depth):
        fidx, ftok, fscore = expand_frontier(depth_tokens[-1], depth_scores[-1], k)
        fctx = None if ctx is None else jnp.take_along_axis(ctx, fidx[..., None], 1)
        ctok, clogp = children(j, ftok, fctx)
        t, s, par = child_candidates(fscore, clogp, ctok, frontier_idx=fidx)
        if ctx is not None:  # a child's path before it: its parent, then the parent's path
            path = jnp.concatenate([ftok[..., None], fctx[..., :-1]], -1)
            ctx = jnp.repeat(path, ctok.shape[-1], axis=1)
        depth_tokens.append(t), depth_scores.append(s), depth_parents.append(par)
    return dynamic_tree(depth_tokens, depth_scores, depth_parents, root_tokens, spec.slots)


def attach_chain(tree: Tree, chain_tokens: jax.Array, m: int) -> Tree:
    """The tree plus `m` slots that continue a deterministic chain proposal (prompt lookup).

    chain_tokens [B, D + m] (D = tree.max_depth) is the proposed continuation of the root. It is
    merged where it fits: the new slots hang below the deepest existing node whose path spells
    the chain's prefix and hold the chain's next m tokens, so shared prefixes are not repeated
    and no path appears twice. New slots follow every existing slot (parents still precede
    children; slots are no longer sorted by depth) and score 0. Depth grows to D + m."""
    b, t = tree.tokens.shape
    d = tree.max_depth
    if chain_tokens.shape != (b, d + m):
        raise ValueError(f"attach_chain: chain tokens must be [B={b}, {d + m}], got {chain_tokens.shape}")
    on_path = jnp.take_along_axis(tree.tokens[:, :, None], jnp.maximum(tree.paths, 0), 1)   # [B, T, D+1]
    same = (tree.paths[:, :, 1:] < 0) | (on_path[:, :, 1:] == chain_tokens[:, None, :d])
    spells = jnp.all(same, -1)                                                           # root always
    deepest = jnp.argmax(jnp.where(spells, tree.depth, -1), -1).astype(jnp.int32)        # lowest slot on ties
    start = jnp.take_along_axis(tree.depth, deepest[:, None], 1)                         # [B, 1]
    new_tokens = jnp.take_along_axis(chain_tokens, start + jnp.arange(m)[None, :], 1)
    new_parents = jnp.concatenate([deepest[:, None], jnp.broadcast_to(t + jnp.arange(m - 1), (b, m - 1))], 1)
    tokens = jnp.concatenate([tree.tokens, new_tokens.astype(jnp.int32)], 1)
    parents = jnp.concatenate([tree.parents, new_parents.astype(jnp.int32)], 1)
    scores = jnp.concatenate([tree.scores, jnp.zeros((b, m), jnp.float32)], 1)
    return build_tree(tokens, parents, scores, d + m)


def pad_tree(tree: Tree, num_slots: int, max_depth: int) -> Tree:
    """The tree in a larger shape: unreachable slots up to `num_slots` (no parent, so no walk and
    no path visits them, and no other slot sees them) and paths up to `max_depth`."""
    b, t = tree.tokens.shape
    if num_slots < t or max_depth < tree.max_depth:
        raise ValueError(f"pad_tree: cannot shrink a {t}-slot depth-{tree.max_depth} tree to {num_slots}/{max_depth}")
    pad = lambda x, v: jnp.concatenate([x, jnp.full((b, num_slots - t), v, x.dtype)], 1)
    return build_tree(pad(tree.tokens, 0), pad(tree.parents, -1), pad(tree.scores, -jnp.inf), max_depth)


def prune_tree(tree: Tree, min_score: float) -> tuple[Tree, jax.Array]:
    """The tree without the slots whose subtree holds no slot scoring at least `min_score` (made
    unreachable as in `pad_tree`; the root stays), and the kept slots [B, T]: the rows a verify
    forward must compute (`llama.forward`'s `active`). Draft scores (cumulative log-probs) only
    fall along a path, so a draft node goes when its own score is below the floor, and takes its
    subtree along, unless a lookup node (score 0) hangs below it: the retrieved continuation keeps
    the path that spells its prefix. Kept slots are closed under ancestors. A deterministic choice
    from the draft alone, so every acceptance rule on the rest stays lossless."""
    ok = tree.scores >= min_score
    keep = jnp.any(tree.mask & ok[:, :, None], 1).at[:, 0].set(True)   # mask[b, j, i]: i is on j's path
    parents = jnp.where(keep, tree.parents, -1)
    return build_tree(tree.tokens, parents, jnp.where(keep, tree.scores, -jnp.inf), tree.max_depth), keep


# ---------------------------------------------------------------------------
# Walks
# ---------------------------------------------------------------------------


def greedy_walk(tree: Tree, target_tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance: from the root, follow the child whose token is the target's argmax.

    target_tokens[b, i] is the target's argmax token after slot i. Among
    siblings with equal tokens the lowest slot (the best-scoring, first in the
    first_child/next_sibling order) wins. Each of the D levels is one
    vectorized compare over all slots (children of ``cur`` are exactly the
    slots with ``parents == cur``), inside a ``fori_loop`` with static trip count.

    Returns num_accepted int32 [B] (0..D), path int32 [B, D+1] (visited slots
    from 0, padded -1) and last_slot int32 [B] (its target token is the bonus
    or correction token).
    """
    batch, _ = tree.tokens.shape
    max_depth = tree.max_depth
    target_tokens = target_tokens.astype(jnp.int32)

    def level(k, state):
        cur, alive, path = state
        want = jnp.take_along_axis(target_tokens, cur[:, None], axis=-1)
        hit = (tree.parents == cur[:, None]) & (tree.tokens == want)
        nxt = _min_slot(hit)
        alive = alive & (nxt >= 0)
        cur = jnp.where(alive, nxt, cur)
        path = path.at[:, k + 1].set(jnp.where(alive, cur, -1))
        return cur, alive, path

    cur = jnp.zeros((batch,), jnp.int32)
    path = jnp.full((batch, max_depth + 1), -1, jnp.int32).at[:, 0].set(0)
    cur, _, path = jax.lax.fori_loop(0, max_depth, level, (cur, jnp.ones((batch,), bool), path))
    num_accepted = jnp.sum(path >= 0, axis=-1).astype(jnp.int32) - 1
    return num_accepted, path, cur


# ---------------------------------------------------------------------------
# Reference structure and validation (numpy; tests and debugging)
# ---------------------------------------------------------------------------


def reference_structure(parents: np.ndarray, max_depth: int) -> dict[str, np.ndarray]:
    """Naive numpy walk over one tree's parents [T]: depth, mask, paths, child links."""
    parents = np.asarray(parents)
    num_slots = parents.shape[0]
    depth = np.zeros(num_slots, np.int32)
    mask = np.zeros((num_slots, num_slots), bool)
    paths = np.full((num_slots, max_depth + 1), -1, np.int32)
    first_child = np.full(num_slots, -1, np.int32)
    next_sibling = np.full(num_slots, -1, np.int32)
    for i in range(num_slots):
        chain = [i]
        while parents[chain[-1]] >= 0:
            chain.append(int(parents[chain[-1]]))
        depth[i] = len(chain) - 1
        mask[i, chain] = True
        paths[i, : len(chain)] = chain[::-1]
    for i in range(num_slots):
        kids = [j for j in range(num_slots) if parents[j] == i]
        if kids:
            first_child[i] = kids[0]
        for a, b in zip(kids, kids[1:]):
            next_sibling[a] = b
    return dict(depth=depth, mask=mask, paths=paths, first_child=first_child, next_sibling=next_sibling)


def check_tree(tree: Tree, score_order: bool = True) -> None:
    """Assert every Tree invariant (numpy); score_order also checks that slots are sorted by depth
    and by descending score within a depth (what the builders produce; `attach_chain` does not)."""
    t = jax.tree.map(np.asarray, tree)
    batch, num_slots = t.tokens.shape
    max_depth = t.paths.shape[-1] - 1
    assert t.parents.shape == t.depth.shape == t.scores.shape == t.first_child.shape == (batch, num_slots)
    assert t.mask.shape == (batch, num_slots, num_slots) and t.mask.dtype == bool
    assert t.paths.shape == (batch, num_slots, max_depth + 1)
    for b in range(batch):
        par, dep = t.parents[b], t.depth[b]
        assert par[0] == -1 and dep[0] == 0 and t.scores[b, 0] == 0, "bad root"
        for i in range(1, num_slots):
            assert 0 <= par[i] < i, f"slot {i}: parent {par[i]} must precede it"
            assert dep[i] == dep[par[i]] + 1, f"slot {i}: depth {dep[i]} != parent depth + 1"
        assert dep.max() <= max_depth, "depth exceeds paths width"
        if score_order:
            assert np.all(np.diff(dep) >= 0), "slots not sorted by depth"
            same = dep[1:] == dep[:-1]
            assert np.all(t.scores[b, 1:][same] <= t.scores[b, :-1][same]), "scores not descending within a depth"
        ref = reference_structure(par, max_depth)
        for name in ("depth", "mask", "paths", "first_child", "next_sibling"):
            np.testing.assert_array_equal(getattr(t, name)[b], ref[name], err_msg=f"{name} (batch {b})")
