"""Tests for hsd_jax.tree: builders produce valid trees, selection and walks match brute force."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsd_jax import tree as tr

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)

jit_dynamic = jax.jit(tr.dynamic_tree, static_argnums=(4,))
jit_chain = jax.jit(tr.chain_tree)
jit_build = jax.jit(tr.build_tree, static_argnums=(3,))
jit_walk = jax.jit(tr.greedy_walk)
jit_expand = jax.jit(tr.expand_frontier, static_argnums=(2,))
jit_children = jax.jit(tr.child_candidates)
jit_positions = jax.jit(tr.positions)
jit_pad = jax.jit(tr.pad_tree, static_argnums=(1, 2))
jit_prune = jax.jit(tr.prune_tree)


def host(tree):
    """A jitted result as numpy: indexing it then runs no eager JAX op (each would compile)."""
    return jax.tree.map(np.asarray, tree)


# ---------------------------------------------------------------------------
# Generators and brute-force references (numpy)
# ---------------------------------------------------------------------------


def child_logp(rng, shape, mode):
    """Child log-probs: continuous, tie-heavy (including exact 0), or sometimes positive."""
    if mode == "ties":
        return rng.choice(np.array([0.0, -0.5, -1.0], np.float32), size=shape)
    if mode == "nonmonotone":
        return rng.normal(size=shape).astype(np.float32)
    return -rng.exponential(size=shape).astype(np.float32)


def eagle2_inputs(rng, batch, k, n_depths, mode="cont", vocab=None):
    """Per-depth candidate arrays as an EAGLE-2 engine drafts them (numpy frontier selection).

    Tokens are unique per candidate (flat id + 10) unless a small vocab is given.
    """
    toks, scores, parents = [], [], []
    offset = 0
    for j in range(n_depths):
        c = k if j == 0 else k * k
        if j == 0:
            s = child_logp(rng, (batch, k), mode)
            p = np.full((batch, k), -1, np.int32)
        else:
            front = np.argsort(-scores[-1], axis=1, kind="stable")[:, :k]
            p = np.repeat(front, k, axis=1).astype(np.int32)
            s = np.take_along_axis(scores[-1], p, axis=1) + child_logp(rng, (batch, c), mode)
        if vocab is None:
            t = np.broadcast_to(np.arange(offset, offset + c) + 10, (batch, c)).astype(np.int32)
        else:
            t = rng.integers(0, vocab, size=(batch, c)).astype(np.int32)
        toks.append(t), scores.append(s.astype(np.float32)), parents.append(p)
        offset += c
    return toks, scores, parents


def flat_view(scores, parents):
    """Flattened path-min keys and global parent ids (-1 = root) for brute-force selection."""
    keys, gpar, offset = [], [], 0
    for j, (s, p) in enumerate(zip(scores, parents)):
        if j == 0:
            keys.append(s.copy()), gpar.append(np.full_like(p, -1))
        else:
            keys.append(np.minimum(s, np.take_along_axis(keys[-1], p, axis=1)))
            gpar.append(p + offset)
            offset += scores[j - 1].shape[1]
    return np.concatenate(keys, 1), np.concatenate(gpar, 1)


def brute_walk(parents, tokens, target):
    """Greedy walk over explicit child lists of one tree."""
    cur, path = 0, [0]
    while True:
        kids = [j for j in range(len(parents)) if parents[j] == cur and tokens[j] == target[cur]]
        if not kids:
            return path
        cur = kids[0]
        path.append(cur)


def random_targets(rng, tree, vocab, p_match=0.85):
    """Target argmax tokens that follow some child of each slot with probability p_match."""
    toks, par = np.asarray(tree.tokens), np.asarray(tree.parents)
    batch, num_slots = toks.shape
    out = rng.integers(0, vocab, size=(batch, num_slots)).astype(np.int32)
    for b in range(batch):
        for i in range(num_slots):
            kids = np.flatnonzero(par[b] == i)
            if kids.size and rng.random() < p_match:
                out[b, i] = toks[b, rng.choice(kids)]
    return out


def check_walk(tree, target):
    n, path, last = (np.asarray(x) for x in jit_walk(tree, jnp.asarray(target)))
    par, toks = np.asarray(tree.parents), np.asarray(tree.tokens)
    for b in range(par.shape[0]):
        ref = brute_walk(par[b], toks[b], target[b])
        assert n[b] == len(ref) - 1 and last[b] == ref[-1]
        np.testing.assert_array_equal(path[b], ref + [-1] * (path.shape[1] - len(ref)))
    return n


# ---------------------------------------------------------------------------
# Structure primitives and chain
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_slots", [1, 2, 3, 5, 9, 10, 17])
def test_chain_tree_is_chain_and_mask_closure_at_depth_boundary(num_slots):
    # Chains are the deepest trees: they exercise the squaring count at every 2**k boundary.
    rng = np.random.default_rng(num_slots)
    d = num_slots - 1
    draft = jnp.asarray(rng.integers(0, 100, (2, d)), jnp.int32)
    cum = jnp.asarray(np.cumsum(-rng.exponential(size=(2, d)), axis=1), jnp.float32)
    for fn in (tr.chain_tree, jit_chain) if num_slots == 5 else (jit_chain,):
        t = host(fn(draft, jnp.array([7, 8]), cum))
        tr.check_tree(t)
        np.testing.assert_array_equal(t.parents[0], np.arange(-1, d))
        np.testing.assert_array_equal(t.depth[1], np.arange(num_slots))
        np.testing.assert_array_equal(t.mask[0], np.tril(np.ones((num_slots, num_slots), bool)))
        np.testing.assert_array_equal(t.tokens[:, 0], [7, 8])
        np.testing.assert_array_equal(t.tokens[:, 1:], draft)
        np.testing.assert_allclose(t.scores[:, 1:], cum)
    assert np.asarray(jit_chain(draft, jnp.array([1, 2])).scores).sum() == 0


def test_chain_walk_accepts_prefix():
    t = jit_chain(jnp.array([[5, 6, 7, 8]]), jnp.array([4]))
    n, path, last = host(jit_walk(t, jnp.array([[5, 6, 9, 8, 1]])))
    assert int(n[0]) == 2 and int(last[0]) == 2
    np.testing.assert_array_equal(path[0], [0, 1, 2, -1, -1])
    n, _, last = host(jit_walk(t, jnp.array([[5, 6, 7, 8, 1]])))
    assert int(n[0]) == 4 and int(last[0]) == 4


def test_positions():
    t = jit_chain(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32))
    np.testing.assert_array_equal(jit_positions(t, jnp.array([10, 20])), [[10, 11, 12, 13], [20, 21, 22, 23]])


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), num_slots=st.sampled_from([1, 2, 6, 13]))
def test_build_tree_random_parents_matches_reference(seed, num_slots):
    rng = np.random.default_rng(seed)
    par = np.array([[-1] + [rng.integers(0, i) for i in range(1, num_slots)] for _ in range(2)], np.int32)
    d = num_slots - 1
    t = host(jit_build(jnp.zeros((2, num_slots)), jnp.asarray(par), jnp.zeros((2, num_slots)), d))
    for b in range(2):
        ref = tr.reference_structure(par[b], d)
        for name in ("depth", "mask", "paths", "first_child", "next_sibling"):
            np.testing.assert_array_equal(getattr(t, name)[b], ref[name], err_msg=name)


# ---------------------------------------------------------------------------
# Dynamic tree
# ---------------------------------------------------------------------------

SHAPES = [(1, 1, 3), (2, 2, 3), (2, 3, 2), (1, 3, 4), (3, 2, 4), (2, 4, 3)]  # (B, K, D)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from(SHAPES),
    frac=st.sampled_from([0.3, 1.0]),
    mode=st.sampled_from(["cont", "ties", "nonmonotone"]),
)
def test_dynamic_tree_keeps_best_and_is_valid(seed, shape, frac, mode):
    batch, k, n_depths = shape
    rng = np.random.default_rng(seed)
    toks, scores, parents = eagle2_inputs(rng, batch, k, n_depths, mode)
    total = k + (n_depths - 1) * k * k
    num_slots = 1 + round(frac * total)
    root = rng.integers(0, 5, batch).astype(np.int32)
    t = jit_dynamic(toks, scores, parents, root, num_slots)
    tr.check_tree(t)
    assert t.paths.shape == (batch, num_slots, n_depths + 1)

    keys, gpar = flat_view(scores, parents)
    flat_tok = np.concatenate(toks, 1)
    tokens, par, sc = np.asarray(t.tokens), np.asarray(t.parents), np.asarray(t.scores)
    np.testing.assert_array_equal(tokens[:, 0], root)
    for b in range(batch):
        want = np.argsort(-keys[b], kind="stable")[: num_slots - 1]
        got = tokens[b, 1:] - 10
        assert set(got.tolist()) == set(want.tolist())
        np.testing.assert_array_equal(sc[b, 1:], keys[b, got])
        for i in range(1, num_slots):
            fp = gpar[b, got[i - 1]]
            assert (par[b, i] == 0) if fp < 0 else (tokens[b, par[b, i]] == flat_tok[b, fp])
        if mode != "nonmonotone":
            flat_s = np.concatenate(scores, 1)[b]
            np.testing.assert_array_equal(sc[b, 1:], flat_s[got])


def test_dynamic_tree_parent_wins_exact_ties():
    # All child log-probs 0: every candidate ties with its parent; the tree must stay closed.
    toks = [jnp.array([[1, 2]]), jnp.array([[3, 4, 5, 6]]), jnp.array([[7, 8, 9, 10]])]
    scores = [jnp.zeros((1, 2)), jnp.zeros((1, 4)), jnp.zeros((1, 4))]
    parents = [jnp.full((1, 2), -1), jnp.array([[0, 0, 1, 1]]), jnp.array([[0, 0, 1, 1]])]
    for n in (2, 4, 7, 11):
        t = host(jit_dynamic(toks, scores, parents, jnp.array([0]), n))
        tr.check_tree(t)
        np.testing.assert_array_equal(t.tokens[0], np.arange(n))


def test_dynamic_tree_slot_order_and_links():
    # depth1: a(-1) b(-2); depth2 children of a: c(-1.5) d(-3); of b: e(-2.5) f(-9)
    toks = [jnp.array([[1, 2]]), jnp.array([[3, 4, 5, 6]])]
    scores = [jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -3.0, -2.5, -9.0]])]
    parents = [jnp.array([[-1, -1]]), jnp.array([[0, 0, 1, 1]])]
    t = host(jit_dynamic(toks, scores, parents, jnp.array([0]), 6))
    tr.check_tree(t)
    np.testing.assert_array_equal(t.tokens[0], [0, 1, 2, 3, 5, 4])
    np.testing.assert_array_equal(t.parents[0], [-1, 0, 0, 1, 2, 1])
    np.testing.assert_array_equal(t.first_child[0], [1, 3, 4, -1, -1, -1])
    np.testing.assert_array_equal(t.next_sibling[0], [-1, 2, -1, 5, -1, -1])
    np.testing.assert_array_equal(t.paths[0, 4], [0, 2, 4])


def test_expand_frontier_and_child_candidates_match_numpy():
    rng = np.random.default_rng(0)
    cand_s = rng.choice([-1.0, -2.0, -3.0], size=(3, 9)).astype(np.float32)
    cand_t = rng.integers(0, 50, (3, 9)).astype(np.int32)
    for fn in (tr.expand_frontier, jit_expand):
        idx, ft, fs = fn(jnp.asarray(cand_t), jnp.asarray(cand_s), 3)
        want = np.argsort(-cand_s, axis=1, kind="stable")[:, :3]
        np.testing.assert_array_equal(idx, want)
        np.testing.assert_array_equal(ft, np.take_along_axis(cand_t, want, 1))
        np.testing.assert_array_equal(fs, np.take_along_axis(cand_s, want, 1))
    lp = -rng.exponential(size=(3, 3, 2)).astype(np.float32)
    ct = rng.integers(0, 50, (3, 3, 2)).astype(np.int32)
    for fn in (tr.child_candidates, jit_children):
        tok, sc, par = fn(fs, jnp.asarray(lp), jnp.asarray(ct))
        np.testing.assert_array_equal(par, np.broadcast_to([0, 0, 1, 1, 2, 2], (3, 6)))
        np.testing.assert_array_equal(tok, ct.reshape(3, 6))
        np.testing.assert_allclose(sc, (np.asarray(fs)[:, :, None] + lp).reshape(3, 6), rtol=1e-6)
        _, _, par = fn(fs, jnp.asarray(lp), jnp.asarray(ct), idx)
        np.testing.assert_array_equal(par, np.repeat(want, 2, axis=1))


@pytest.mark.parametrize("k,n_depths,num_slots", [(2, 3, 7), (3, 4, 16)])
def test_eagle2_drafting_loop_end_to_end(k, n_depths, num_slots):
    """Draft depth by depth with expand_frontier/child_candidates under jit, then build and walk."""
    vocab = 6

    @partial(jax.jit, static_argnums=(1,))
    def draft(key, num_nodes):
        keys = jax.random.split(key, n_depths + 1)
        root = jax.random.randint(keys[0], (2,), 0, vocab)

        def topk_children(kk, shape):
            logp = jax.nn.log_softmax(jax.random.normal(kk, shape + (vocab,)), axis=-1)
            return jax.lax.top_k(logp, k)

        lp, tk = topk_children(keys[1], (2,))
        toks, scores, parents = [tk], [lp], [jnp.full((2, k), -1, jnp.int32)]
        for j in range(1, n_depths):
            idx, _, fs = tr.expand_frontier(toks[-1], scores[-1], k)
            lp, tk = topk_children(keys[j + 1], (2, k))
            t, s, p = tr.child_candidates(fs, lp, tk, idx)
            toks.append(t), scores.append(s), parents.append(p)
        return tr.dynamic_tree(toks, scores, parents, root, num_nodes)

    rng = np.random.default_rng(k)
    for seed in range(3):
        t = draft(jax.random.PRNGKey(seed), num_slots)
        tr.check_tree(t)
        check_walk(t, random_targets(rng, t, vocab))


def test_dynamic_tree_errors():
    toks = [jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 4), jnp.int32)]
    scores = [jnp.zeros((1, 2)), jnp.zeros((1, 4))]
    parents = [jnp.full((1, 2), -1), jnp.zeros((1, 4), jnp.int32)]
    root = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="only 6 candidates"):
        tr.dynamic_tree(toks, scores, parents, root, 8)
    with pytest.raises(ValueError, match="only 6 candidates"):
        jit_dynamic(toks, scores, parents, root, 8)
    with pytest.raises(ValueError, match="num_nodes must be >= 1"):
        tr.dynamic_tree(toks, scores, parents, root, 0)
    with pytest.raises(ValueError, match="share shape"):
        tr.dynamic_tree(toks, [scores[0], jnp.zeros((1, 3))], parents, root, 3)
    with pytest.raises(ValueError, match="number of depths"):
        tr.dynamic_tree(toks, scores[:1], parents, root, 3)
    with pytest.raises(ValueError, match="number of depths"):
        tr.dynamic_tree([], [], [], root, 1)
    with pytest.raises(ValueError, match="exceeds"):
        tr.expand_frontier(toks[0], scores[0], 3)


# ---------------------------------------------------------------------------
# Greedy walk
# ---------------------------------------------------------------------------


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from(SHAPES),
    frac=st.sampled_from([0.3, 1.0]),
    vocab=st.sampled_from([2, 4]),
)
def test_greedy_walk_matches_brute_force(seed, shape, frac, vocab):
    batch, k, n_depths = shape
    rng = np.random.default_rng(seed)
    toks, scores, parents = eagle2_inputs(rng, batch, k, n_depths, "ties", vocab=vocab)
    num_slots = 1 + round(frac * (k + (n_depths - 1) * k * k))
    t = jit_dynamic(toks, scores, parents, rng.integers(0, vocab, batch).astype(np.int32), num_slots)
    n = check_walk(t, random_targets(rng, t, vocab))
    assert np.all((n >= 0) & (n <= n_depths))


def test_check_tree_rejects_broken_trees():
    t = host(jit_chain(jnp.array([[5, 6, 7]]), jnp.array([4])))
    with pytest.raises(AssertionError):
        tr.check_tree(t.replace(parents=np.array([[-1, 0, 3, 2]])))
    with pytest.raises(AssertionError):
        tr.check_tree(t.replace(mask=np.ones_like(t.mask)))
    with pytest.raises(AssertionError):
        tr.check_tree(t.replace(next_sibling=np.array([[-1, 2, -1, -1]])))


def test_eager_matches_jit_and_single_slot_trees():
    """Eager and jitted builders and walks agree; T = 1 (root only) works."""
    rng = np.random.default_rng(1)
    toks, scores, parents = eagle2_inputs(rng, 2, 2, 3, "ties", vocab=3)
    root = np.array([0, 1], np.int32)
    for num_slots in (1, 7):   # eager: every op dispatched on its own
        t = tr.dynamic_tree(toks, scores, parents, root, num_slots)
        t_jit = jit_dynamic(toks, scores, parents, root, num_slots)
        tr.check_tree(t)
        for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(t_jit)):
            np.testing.assert_array_equal(a, b)
        target = jnp.asarray(random_targets(rng, t, 3))
        for a, b in zip(tr.greedy_walk(t, target), jit_walk(t, target)):
            np.testing.assert_array_equal(a, b)
    root_only = jit_dynamic(toks, scores, parents, root, 1)
    n, path, last = host(jit_walk(root_only, jnp.zeros((2, 1), jnp.int32)))
    np.testing.assert_array_equal(n, [0, 0]), np.testing.assert_array_equal(last, [0, 0])
    np.testing.assert_array_equal(path, [[0, -1, -1, -1]] * 2)


def test_attach_chain_hangs_the_chain_below_its_longest_spelled_prefix():
    # root(9) -> a:1 -> c:3 ; root -> b:2 -> d:4 ; depth 2
    t = jit_build(jnp.array([[9, 1, 2, 3, 4]] * 4), jnp.array([[-1, 0, 0, 1, 2]] * 4), jnp.zeros((4, 5)), 2)
    chains = jnp.array([[1, 3, 7, 8, 6],    # spells root-a-c: hang below c (slot 3)
                        [2, 5, 7, 8, 6],    # spells root-b only: below b (slot 2), from token 5
                        [6, 6, 7, 8, 6],    # spells nothing: below the root
                        [2, 4, 2, 4, 2]])   # full match then continues
    out = host(jax.jit(tr.attach_chain, static_argnums=2)(t, chains, 3))
    tr.check_tree(out, score_order=False)
    assert out.max_depth == 5 and out.num_slots == 8
    assert np.asarray(out.parents)[:, 5:].tolist() == [[3, 5, 6], [2, 5, 6], [0, 5, 6], [4, 5, 6]]
    assert np.asarray(out.tokens)[:, 5:].tolist() == [[7, 8, 6], [5, 7, 8], [6, 6, 7], [2, 4, 2]]
    # no node has two children with the same token: every root-to-node token path is distinct
    for b in range(4):
        par, tok = np.asarray(out.parents[b]), np.asarray(out.tokens[b])
        kids = [(int(par[i]), int(tok[i])) for i in range(1, 8)]
        assert len(set(kids)) == len(kids)
    # greedy walk follows the merged chain: a target that wants 1,3,7,8,6 accepts all five
    want = jnp.array([[1, 3, 9, 7, 9, 8, 6, 0]])
    m, path, _ = host(jit_walk(jax.tree.map(lambda x: x[:1], out), want))
    assert int(m[0]) == 5 and path[0].tolist() == [0, 1, 3, 5, 6, 7]


def test_padded_slots_are_never_reached():
    """`pad_tree`: the larger shape's extra slots have no parent, so no walk reaches them even when
    they hold the token the target wants."""
    p = jit_pad(jit_chain(jnp.asarray([[5, 6]]), jnp.asarray([4])), 6, 4)
    assert p.tokens.shape == (1, 6) and p.max_depth == 4
    m, _, last = host(jit_walk(p, jnp.zeros((1, 6), jnp.int32)))    # the pads hold 0, the target wants 0
    assert int(m[0]) == 0 and int(last[0]) == 0
    m, path, _ = host(jit_walk(p, jnp.asarray([[5, 6, 9, 0, 0, 0]])))
    assert int(m[0]) == 2 and path[0].tolist() == [0, 1, 2, -1, -1]
    assert not np.asarray(p.mask)[0, :3, 3:].any()                        # no real slot sees a pad


def test_pruned_slots_and_their_descendants_are_never_reached():
    """`prune_tree`: a draft slot below the score floor, and everything under it, is unreachable
    and inactive, unless a lookup node (score 0) hangs below it; the rest of the tree and its
    walks are unchanged."""
    log = np.log
    # root -> 1 (0.9) -> 3 (0.9*0.5); root -> 2 (0.05) -> 4 (0.02): pruned;
    # root -> 5 (0.04) -> 6 (a lookup node, score 0): kept with the unlikely slot it hangs below
    t = jit_build(jnp.asarray([[7, 5, 6, 8, 9, 4, 3]]), jnp.asarray([[-1, 0, 0, 1, 2, 0, 5]]),
                  jnp.asarray([[0.0, log(0.9), log(0.05), log(0.45), log(0.02), log(0.04), 0.0]]), 2)
    p, keep = jit_prune(t, float(log(0.1)))
    assert np.asarray(keep)[0].tolist() == [True, True, False, True, False, True, True]
    assert np.asarray(p.parents)[0].tolist() == [-1, 0, -1, 1, -1, 0, 5]
    m, path, _ = host(jit_walk(p, jnp.asarray([[6, 9, 9, 0, 0, 0, 0]])))    # the target wants the pruned branch
    assert int(m[0]) == 0 and path[0].tolist() == [0, -1, -1]
    m, path, _ = host(jit_walk(p, jnp.asarray([[5, 8, 0, 3, 0, 0, 0]])))
    assert int(m[0]) == 2 and path[0].tolist() == [0, 1, 3]
    m, path, _ = host(jit_walk(p, jnp.asarray([[4, 0, 0, 0, 0, 3, 0]])))    # the lookup continuation
    assert int(m[0]) == 2 and path[0].tolist() == [0, 5, 6]
    kept, pruned = [0, 1, 3, 5, 6], [2, 4]
    assert not np.asarray(p.mask)[0][np.ix_(kept, pruned)].any()              # no kept slot sees a pruned one
    same, keep = jit_prune(t, -np.inf)
    assert bool(np.asarray(keep).all()) and np.array_equal(same.parents, t.parents)
