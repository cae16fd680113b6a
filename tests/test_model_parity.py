"""The JAX target against transformers' PyTorch implementation on the same weights."""
import numpy as np
import pytest

from hsd_jax.api import generate, load_target
from tests.helpers import jax_logits, torch_greedy, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_TOL_F32 = 1e-3  # max |logit difference| allowed in f32 (measured ~1.2e-4 on SmolLM2)


def test_smollm2_logits_match_pytorch(smol, smol_torch, mt_prompts):
    ids = smol.encode(mt_prompts[0], chat=True)
    ours = jax_logits(smol.params, smol.config, [ids])
    ref = torch_logits(smol_torch, [ids])
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < LOGIT_TOL_F32


def test_smollm2_greedy_64_tokens_match_pytorch(smol, smol_torch, mt_prompts):
    prompts = [smol.encode(mt_prompts[i], chat=True) for i in (0, 10, 40)]
    ours = generate(smol, prompts, max_new_tokens=64)   # one batch, one compile (batched = alone: test_generate)
    for ids, res in zip(prompts, ours):
        assert res.token_ids == torch_greedy(smol_torch, ids, 64)


def _tiny_hf(tmp_path, cls_name, cfg_name, **kw):
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(vocab_size=300, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=512, **kw)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _check_dir_matches(tmp_path, model, length=48):
    tgt = load_target(str(tmp_path), tokenizer=False)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, length))
    ours = jax_logits(tgt.params, tgt.config, tokens)
    ref = torch_logits(model, tokens)
    assert np.abs(ours - ref).max() < 1e-3
    return tgt


def test_qwen2_checkpoint_with_bias_and_untied_head(tmp_path):
    model = _tiny_hf(tmp_path, "Qwen2ForCausalLM", "Qwen2Config", tie_word_embeddings=False)
    tgt = _check_dir_matches(tmp_path, model)
    assert tgt.config.attention_bias and not tgt.config.tie_word_embeddings
    assert "bias" in tgt.params["layers"]["q_proj"] and "lm_head" in tgt.params


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 4.0},
])
def test_llama_rope_scaling_matches(tmp_path, scaling):
    model = _tiny_hf(tmp_path, "LlamaForCausalLM", "LlamaConfig", rope_scaling=dict(scaling, rope_theta=10000.0))
    tgt = _check_dir_matches(tmp_path, model, length=64)
    assert tgt.config.rope_scaling.rope_type == scaling["rope_type"]


def test_sharded_checkpoint_loads(tmp_path):
    model = _tiny_hf(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _check_dir_matches(tmp_path / "sharded", model)


def test_streamed_head_matches_the_dot(smol):
    """The serving head's one-pass form (CPU, 2-32 rows) gives the dot's logits and argmax."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from hsd_jax.models import llama

    cfg = smol.config
    assert [llama.streams_head_rows(cfg, n) for n in (1, 2, 32, 33)] == [False, True, True, False]
    assert not llama.streams_head_rows(dataclasses.replace(cfg, dtype="bfloat16"), 4)
    assert not llama.streams_head_rows(dataclasses.replace(cfg, tie_word_embeddings=False), 4)
    for shape in ((1, 3), (2, 9), (4, 8)):
        feats = 32.0 * jax.random.normal(jax.random.key(sum(shape)), shape + (cfg.hidden_size,))
        streamed = jax.jit(llama.serving_logits, static_argnums=1)(smol.params, cfg, feats)
        dot = jax.jit(llama.logits_from_features, static_argnums=1)(smol.params, cfg, feats)
        assert streamed.shape == dot.shape == shape + (cfg.vocab_size,)
        assert float(jnp.abs(streamed - dot).max()) < 1e-3
        assert (jnp.argmax(streamed, -1) == jnp.argmax(dot, -1)).all()
