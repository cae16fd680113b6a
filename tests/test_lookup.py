"""Prompt lookup: the vectorised search against a plain Python one, and lossless copy-heavy decoding."""
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import generate, load_drafter
from hsd_jax.config import ConfigError
from hsd_jax.methods.lookup import LookupConfig, committed_sequence, lookup_chain
from tests.helpers import bigram_target


def _reference(seq, k, max_n, min_n):
    """The k tokens after the latest earlier occurrence of the longest matching suffix n-gram,
    how many are real, and the n-gram's length (0: no match)."""
    for n in range(max_n, min_n - 1, -1):
        if len(seq) <= n:
            continue
        suffix = seq[-n:]
        for end in range(len(seq) - 2, n - 2, -1):
            if seq[end - n + 1: end + 1] == suffix:
                cont = seq[end + 1: end + 1 + k]
                return cont + [seq[-1]] * (k - len(cont)), len(cont), n
    return [seq[-1]] * k, 0, 0


@pytest.mark.parametrize("max_n, min_n", [(3, 1), (2, 2), (4, 2)])
def test_vectorised_search_matches_a_python_scan(max_n, min_n):
    rng = np.random.default_rng(max_n * 10 + min_n)
    seqs = [rng.integers(0, v, size=n).tolist() for v, n in [(3, 20), (5, 30), (50, 12), (4, 1), (2, 7), (6, 40)]]
    cap = 48
    buf = np.zeros((len(seqs), cap), np.int32)
    for i, s in enumerate(seqs):
        buf[i, : len(s)] = s
    toks, real, matched = lookup_chain(jnp.asarray(buf), jnp.asarray([len(s) for s in seqs]), 5, max_n, min_n)
    for i, s in enumerate(seqs):
        want, n_real, n = _reference(s, 5, max_n, min_n)
        assert np.asarray(toks[i]).tolist() == want, (i, s)
        assert int(real[i]) == n_real and int(matched[i]) == n


def test_committed_sequence_joins_prompt_and_generated_tokens():
    prompt = jnp.asarray([[1, 2, 3, 0], [7, 8, 0, 0]])
    gen = jnp.asarray([[4, 5, -1], [9, -1, -1]])
    seq, length = committed_sequence(prompt, jnp.asarray([3, 2]), gen, jnp.asarray([2, 1]))
    assert length.tolist() == [5, 3]
    assert np.asarray(seq)[0, :5].tolist() == [1, 2, 3, 4, 5] and np.asarray(seq)[1, :3].tolist() == [7, 8, 9]


def test_lookup_is_lossless_and_free_and_drafts_well_on_copy_heavy_text():
    tgt = bigram_target()   # the next token depends on the last one only: greedy text cycles
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, size=9).tolist(), [5]]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=60)]
    res = generate(tgt, prompts, max_new_tokens=60, method="lookup", gamma=6)   # no drafter: the defaults
    assert [r.token_ids for r in res] == ref
    assert all(r.stats["drafter_forwards"] == 0 for r in res)
    # once the text repeats itself, every lookup chain is right
    assert all(r.stats["tau"] > 3 for r in res), [r.stats["tau"] for r in res]
    narrow = generate(tgt, prompts, max_new_tokens=60, method="lookup", gamma=6,
                      drafter=load_drafter("lookup", target=tgt, max_ngram=2, min_ngram=2))
    assert [r.token_ids for r in narrow] == ref
    with pytest.raises(ConfigError, match="min_ngram <= max_ngram"):
        LookupConfig(max_ngram=1, min_ngram=2)


def test_lookup_slots_join_a_learned_tree_losslessly_and_accept_more_on_copy_heavy_text():
    """hsd / eagle with M lookup nodes in the same verify forward: identical to ar, and on text
    that repeats itself the lookup nodes carry a random drafter's tree far past its own depth."""
    tgt = bigram_target()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, size=9).tolist(), [5, 9]]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=48)]
    shape = dict(tree_nodes=4, tree_depth=2, tree_top_k=2)
    for kind in ("hsd", "eagle"):
        d = load_drafter(kind, target=tgt, random_init=True, seed=3)
        alone = generate(tgt, prompts, max_new_tokens=48, method=kind, drafter=d, **shape)
        hybrid = generate(tgt, prompts, max_new_tokens=48, method=kind, drafter=d, lookup_slots=4, **shape)
        assert [r.token_ids for r in alone] == [r.token_ids for r in hybrid] == ref
        for a, h in zip(alone, hybrid):
            assert h.stats["lookup_slots"] == 4 and len(h.stats["accepted_hist"]) == 2 + 4 + 1
            assert h.stats["tau"] > 2.5 > a.stats["tau"], (kind, a.stats["tau"], h.stats["tau"])
            assert 0 < h.stats["lookup_rounds"] < h.stats["rounds"]   # the first rounds had no 2-token match
            assert h.stats["drafter_forwards"] <= a.stats["drafter_forwards"]
    with pytest.raises(ConfigError, match="drafts a chain"):
        generate(tgt, prompts, max_new_tokens=4, method="sd", drafter=load_drafter("sd", target=tgt, random_init=True),
                 lookup_slots=2)


def test_lookup_nodes_join_the_rounds_whose_match_is_long_enough():
    """`lookup_min_match` N: a round verifies the lookup nodes only when some live sequence's
    match is at least N tokens long; output identical to ar for every N; a batch verifies them
    when any of its sequences needs them."""
    tgt = bigram_target()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 64, size=12).tolist(), [7]]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=40)]
    d = load_drafter("hsd", target=tgt, random_init=True, seed=4)
    shape = dict(tree_nodes=3, tree_depth=2, tree_top_k=2, lookup_slots=3)
    runs = {n: generate(tgt, prompts, max_new_tokens=40, method="hsd", drafter=d, lookup_min_match=n, **shape)
            for n in (0, 1, 3)}
    one = {n: generate(tgt, prompts[1:], max_new_tokens=40, method="hsd", drafter=d, lookup_min_match=n, **shape)[0]
           for n in (0, 3)}
    for n, res in runs.items():
        assert [r.token_ids for r in res] == ref, n
    every, some, longest = ([r.stats["lookup_rounds"] / r.stats["rounds"] for r in runs[n]] for n in (0, 1, 3))
    assert every == [1.0, 1.0]
    assert all(0 < x < 1 for x in longest) and all(a >= b for a, b in zip(some, longest))
    assert one[0].stats["lookup_rounds"] == one[0].stats["rounds"]
    assert one[3].stats["lookup_rounds"] < one[3].stats["rounds"]
    # alone, the one-token prompt waits longer for a 3-token match than when batched with the long prompt
    assert one[3].stats["lookup_rounds"] / one[3].stats["rounds"] <= longest[1]
    with pytest.raises(ConfigError, match="lookup_min_match"):
        generate(tgt, prompts, max_new_tokens=8, method="hsd", drafter=d, lookup_min_match=4, **shape)
