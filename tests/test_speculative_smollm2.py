"""HSD's reuse policies reproduce SmolLM2's greedy output on real prompts with a random drafter
(every method with its shipped drafter, hsd's `refresh` included: tests/test_shipped_drafters.py)."""
import json

import pytest

from hsd_jax import generate, load_drafter
from tests.helpers import run_cli

CASES = [("hsd", dict(reuse="chain")), ("hsd", dict(reuse="none"))]


@pytest.fixture(scope="module")
def smol_prompts(smol, mt_prompts):
    return [smol.encode(mt_prompts[i], chat=True) for i in (0, 10, 40)]


@pytest.fixture(scope="module")
def smol_ar(smol, smol_prompts):
    return [r.token_ids for r in generate(smol, smol_prompts, max_new_tokens=40)]


@pytest.mark.parametrize("method, opts", CASES)
def test_smollm2_speculative_greedy_equals_ar(smol, smol_prompts, smol_ar, method, opts):
    drafter = load_drafter(method, target=smol, random_init=True, seed=0,
                           **({} if method == "sd" else dict(draft_vocab_size=8192)))
    res = generate(smol, smol_prompts, max_new_tokens=40, method=method, drafter=drafter, **opts)
    assert [r.token_ids for r in res] == smol_ar


def test_cli_speculative_json_and_missing_drafter(tmp_path):
    cmd = ["generate", "--prompt", "Name three primary colors.", "--chat", "--max-new-tokens", "8", "--method", "hsd"]
    r = run_cli(*cmd, "--drafter", str(tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: drafter directory not found: {tmp_path / 'none'}"]
    r = run_cli(*cmd, "--drafter", str(tmp_path))
    assert r.returncode == 2 and "not a drafter directory" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli(*cmd, "--random-drafter", "--reuse", "none", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["method"] == "hsd" and out["target_forwards"] >= 1 and out["drafter_forwards"] >= 1
    assert out["tau"] >= 1.0 and 1 <= out["new_tokens"] <= 8
