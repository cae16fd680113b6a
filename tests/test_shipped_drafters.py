"""The trained drafters shipped for SmolLM2-135M load by default, stay lossless and beat tau = 1."""
import os

import pytest

from hsd_jax import generate, load_drafter
from hsd_jax.api import SHIPPED_DRAFTERS

# Measured on these prompts at ship time: hsd 1.57, eagle 1.62, eagle3 1.59, ngram 1.34, sd 1.09 (random drafters and
# tables: 1.0-1.06), with this fixed draft budget (not the per-machine tuned tree, which would make the floor drift).
MIN_TAU = {"hsd": 1.35, "eagle": 1.35, "eagle3": 1.35, "sd": 1.05, "ngram": 1.15}
TREE = dict(tree_nodes=8, tree_depth=4, tree_top_k=3)
BUDGET = {"hsd": dict(TREE, reuse="refresh"), "eagle": TREE, "eagle3": TREE, "sd": dict(gamma=4), "ngram": TREE}
SHIPPED = sorted(k for k in ("hsd", "eagle", "eagle3", "sd", "ngram")
                 if os.path.isfile(os.path.join(SHIPPED_DRAFTERS, "smollm2-135m", k, "drafter.json")))


def test_hsd_drafter_is_shipped():
    assert {"hsd", "eagle", "eagle3", "sd", "ngram"} <= set(SHIPPED)
    assert os.path.isfile(os.path.join(SHIPPED_DRAFTERS, "smollm2-135m", "hsd", "MODEL_CARD.md"))


@pytest.fixture(scope="module")
def prompts_and_ar(smol, mt_prompts):
    """Two MT-bench prompts and their greedy ar tokens, shared by every drafter's case."""
    ids = [smol.encode(mt_prompts[i], chat=True) for i in (3, 7)]
    return ids, [r.token_ids for r in generate(smol, ids, max_new_tokens=48)]


@pytest.mark.parametrize("kind", SHIPPED)
def test_shipped_drafter_is_lossless_and_accepts(smol, prompts_and_ar, kind):
    drafter = load_drafter(kind, target=smol)
    assert drafter.path.endswith(os.path.join("smollm2-135m", kind))
    ids, ref = prompts_and_ar
    res = generate(smol, ids, max_new_tokens=48, method=kind, drafter=drafter, **BUDGET[kind])
    assert [r.token_ids for r in res] == ref
    rounds = sum(r.stats["rounds"] for r in res)
    assert sum(r.stats["new_tokens"] - 1 for r in res) / rounds > MIN_TAU[kind]


def test_shipped_eagle3_exports_to_the_published_format_losslessly(smol, mt_prompts, tmp_path):
    """The shipped eagle3 drafter, written in the EAGLE-3 format other engines load and read back,
    drafts exactly as before: same tokens, same acceptance."""
    from hsd_jax.api import export_eagle3

    export_eagle3(load_drafter("eagle3", target=smol).path, str(tmp_path / "published"))
    assert sorted(os.listdir(tmp_path / "published")) == ["config.json", "model.safetensors"]
    ids = [smol.encode(mt_prompts[5], chat=True)]
    runs = [generate(smol, ids, max_new_tokens=32, method="eagle3", drafter=load_drafter("eagle3", path, target=smol),
                     **TREE)[0] for path in (None, str(tmp_path / "published"))]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats["accepted_hist"] == runs[1].stats["accepted_hist"]
