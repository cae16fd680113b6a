"""Loader errors and the `hsd` command line: bad input is one clear line and exit status 2."""
import json

import numpy as np
import pytest

from hsd_jax.api import load_target
from hsd_jax.loading.convert import expected_shapes
from hsd_jax.loading.errors import ModelLoadError
from hsd_jax.loading.hf import hf_config
from tests.helpers import run_cli


def _hsd(*args):
    return run_cli(*args)


def test_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_target(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_target(str(tmp_path), tokenizer=False)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_target(str(bad))


def test_unsupported_architecture_is_refused():
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'"):
        hf_config({"model_type": "gpt2"}, "somewhere")


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        load_target(str(tmp_path), tokenizer=False)


def test_mismatched_shapes_are_refused(tmp_path):
    from safetensors.numpy import save_file

    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: np.zeros(s, np.float32) for k, s in expected_shapes(hf_config(cfg, "x")).items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((12, 8), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj.weight has shape \(12, 8\), but the config implies \(16, 8\)"):
        load_target(str(tmp_path), tokenizer=False)


def test_bad_config_values_are_refused():
    with pytest.raises(ModelLoadError, match="multiple of num_kv_heads"):
        hf_config({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                   "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3}, "cfg")


@pytest.mark.parametrize("args, message", [
    (["--prompt", "   "], "prompt 0 is empty"),
    (["--prompt", "hi", "--max-new-tokens", "-3"], "max_new_tokens must be >= 1"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature must be >= 0"),
    (["--prompt", "hi", "--method", "hsd", "--tree-nodes", "0"], "tree_nodes must be >= 1"),
    (["--prompt", "hi", "--method", "hsd", "--tree-nodes", "40", "--tree-depth", "2", "--top-k", "2"],
     "exceeds the 6 candidates"),
    (["--prompt", "hi", "--method", "sd", "--lookup-slots", "2"], "drafts a chain"),
    (["--prompt", "hi", "--method", "hsd", "--lookup-slots", "-1"], "lookup_slots must be >= 0"),
    (["--prompt", "hi", "--method", "hsd", "--lookup-slots", "2", "--lookup-min-match", "5"], "lookup_min_match must be in 0..3"),
    (["--prompt", "hi", "--method", "hsd", "--min-draft-prob", "1"], "min_draft_prob must be in [0, 1)"),
    (["--prompt", "hi", "--method", "sd", "--min-draft-prob", "0.1"], "min_draft_prob prunes a draft tree"),
    (["--prompt", "hi", "--drafter", "."], "need a speculative --method"),
    (["--prompt", "hi", "--model", "no-such-model"], "unknown model"),
    (["--prompt", "hi", "--mesh", "2"], "DATAxMODEL"),
    (["--prompt", "hi", "--mesh", "1x2"], "needs 2 devices"),
])
def test_cli_bad_input_exits_2_with_one_line(args, message):
    r = _hsd("generate", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_cli_prompt_longer_than_cache_and_json_output(mt_prompts):
    r = _hsd("generate", "--prompt", mt_prompts[0], "--max-cache-len", "32")
    assert r.returncode == 2 and "exceeds the cache" in r.stderr.strip().splitlines()[-1]
    r = _hsd("generate", "--prompt", mt_prompts[1], "--chat", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["new_tokens"] == len(out["token_ids"]) <= 12 and out["text"].strip()
    assert out["tokens_per_s"] > 0 and out["method"] == "ar"
