"""The n-gram floor drafter: bigram counting, fallback rows, building it from data with the CLI."""
import json

import numpy as np
import pytest

from hsd_jax.config import ConfigError
from hsd_jax.models.ngram import NgramConfig, bigram_table
from tests.helpers import run_cli, save_hf_dir, tiny_target


def test_bigram_table_counts_response_successors():
    cfg = NgramConfig(vocab_size=10, top_k=2)
    # prompt [9, 1] then response [2, 3, 2, 4, 2, 3]: pairs 1>2, 2>3, 3>2, 2>4, 4>2, 2>3 (the prompt's 9>1 is not counted)
    table = bigram_table([np.array([9, 1, 2, 3, 2, 4, 2, 3])], [2], cfg)
    tok, logp = table["next_tokens"], table["next_logp"]
    assert tok[2].tolist() == [3, 4] and np.allclose(np.exp(logp[2]), [2 / 3, 1 / 3])
    assert tok[1].tolist()[0] == 2 and logp[1][0] == 0.0
    # a token seen with one successor: the rest of its row falls back to the most frequent tokens, scored far lower
    assert tok[4][0] == 2 and logp[4][1] < -10
    # never seen as a predecessor: all fallback, most frequent first (2 thrice, then 3 twice)
    assert tok[9].tolist() == [2, 3] and np.all(logp[9] < -10)
    # ties break by the lower token id
    tie = bigram_table([np.array([0, 5, 0, 4, 0, 6])], [0], NgramConfig(vocab_size=10, top_k=3))
    assert tie["next_tokens"][0].tolist() == [4, 5, 6]


def test_bad_ngram_input_is_refused():
    with pytest.raises(ConfigError, match="top_k must be in"):
        NgramConfig(vocab_size=10, top_k=0)
    with pytest.raises(ConfigError, match=r"must be ids in \[0, 10\)"):
        bigram_table([np.array([1, 2, 12])], [1], NgramConfig(vocab_size=10))
    from hsd_jax import load_drafter

    small, big = tiny_target(vocab=64), tiny_target(vocab=96)
    d = load_drafter("ngram", target=small, random_init=True)
    with pytest.raises(ConfigError, match="does not match the target's 96"):
        d.config.check_target(big.config)


def test_hsd_data_ngram_builds_a_loadable_drafter(tmp_path):
    from hsd_jax import generate, load_drafter
    from hsd_jax.train.data import generate_data

    tiny = tiny_target(vocab=64, seed=5)
    model = tmp_path / "model"
    save_hf_dir(tiny, str(model))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, size=6).tolist() for _ in range(40)]
    generate_data(tiny, prompts, str(tmp_path / "data"), batch_size=20, max_new_tokens=16, progress=False)
    cmd = ["data", "ngram", "--model", str(model), "--data", str(tmp_path / "data"),
           "--out", str(tmp_path / "ngram"), "--top-k", "3"]
    r = run_cli(*cmd)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["pairs"] == 40 * 16
    assert "640 response bigrams" in open(tmp_path / "ngram" / "MODEL_CARD.md").read()
    dr = load_drafter("ngram", str(tmp_path / "ngram"), target=tiny)
    assert dr.params["next_tokens"].shape == (64, 3)
    ref = generate(tiny, prompts[:3], max_new_tokens=24)
    res = generate(tiny, prompts[:3], max_new_tokens=24, method="ngram", drafter=dr, tree_nodes=6, tree_depth=3,
                   tree_top_k=2)
    assert [x.token_ids for x in res] == [x.token_ids for x in ref]
    assert sum(x.stats["drafter_forwards"] for x in res) == 0
    # on its own training prompts the table has seen every greedy successor: it accepts more than random
    rand = generate(tiny, prompts[:3], max_new_tokens=24, method="ngram", tree_nodes=6, tree_depth=3, tree_top_k=2,
                    drafter=load_drafter("ngram", target=tiny, random_init=True, top_k=3))
    assert sum(x.stats["rounds"] for x in res) < sum(x.stats["rounds"] for x in rand)
    bad = run_cli(*cmd[:4], "--data", str(tmp_path / "none"), "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: no training data in")


def test_tree_wider_than_the_table_is_refused():
    from hsd_jax import InputError, generate, load_drafter

    tiny = tiny_target(vocab=64)
    dr = load_drafter("ngram", target=tiny, random_init=True, top_k=2)
    with pytest.raises(InputError, match="tree_top_k 3 exceeds the n-gram table's 2"):
        generate(tiny, [[1, 2, 3]], max_new_tokens=8, method="ngram", drafter=dr, tree_nodes=6, tree_depth=2,
                 tree_top_k=3)
