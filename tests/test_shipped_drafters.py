"""The trained drafters shipped for SmolLM2-135M load by default, stay lossless and beat tau = 1."""
import os

import pytest

from hsd_jax import generate, load_drafter
from hsd_jax.api import SHIPPED_DRAFTERS

# Measured on these prompts at ship time: hsd 1.57, eagle 1.62, ngram 1.34, sd 1.09 (random drafters and
# tables: 1.0-1.06), with this fixed draft budget (not the per-machine tuned tree, which would make the floor drift).
MIN_TAU = {"hsd": 1.35, "eagle": 1.35, "sd": 1.05, "ngram": 1.15}
BUDGET = {"hsd": dict(tree_nodes=8, tree_depth=4, tree_top_k=3, reuse="refresh"),
          "eagle": dict(tree_nodes=8, tree_depth=4, tree_top_k=3), "sd": dict(gamma=4),
          "ngram": dict(tree_nodes=8, tree_depth=4, tree_top_k=3)}
SHIPPED = sorted(k for k in ("hsd", "eagle", "sd", "ngram")
                 if os.path.isfile(os.path.join(SHIPPED_DRAFTERS, "smollm2-135m", k, "drafter.json")))


def test_hsd_drafter_is_shipped():
    assert {"hsd", "eagle", "sd", "ngram"} <= set(SHIPPED)
    assert os.path.isfile(os.path.join(SHIPPED_DRAFTERS, "smollm2-135m", "hsd", "MODEL_CARD.md"))


@pytest.mark.parametrize("kind", SHIPPED)
def test_shipped_drafter_is_lossless_and_accepts(smol, mt_prompts, kind):
    drafter = load_drafter(kind, target=smol)
    assert drafter.path.endswith(os.path.join("smollm2-135m", kind))
    ids = [smol.encode(mt_prompts[i], chat=True) for i in (3, 7)]
    ref = [r.token_ids for r in generate(smol, ids, max_new_tokens=48)]
    res = generate(smol, ids, max_new_tokens=48, method=kind, drafter=drafter, **BUDGET[kind])
    assert [r.token_ids for r in res] == ref
    rounds = sum(r.stats["rounds"] for r in res)
    assert sum(r.stats["new_tokens"] - 1 for r in res) / rounds > MIN_TAU[kind]
