"""The target model gives the same outputs with the Pallas tree-attention kernel and the jnp reference."""
import numpy as np

from hsd_jax.api import generate
from hsd_jax.cache import init_cache
from hsd_jax.models import llama
from tests.helpers import tiny_target


def test_verify_forward_pallas_matches_reference():
    ref_t = tiny_target(heads=6, kv_heads=2, hidden=48, layers=2)
    cfg_ref = ref_t.config
    cfg_pal = cfg_ref.replace(attention_impl="pallas")
    b, t_prompt, n = 2, 11, 7
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 64, (b, t_prompt)).astype(np.int32)
    cache = init_cache(cfg_ref.num_layers, b, cfg_ref.num_kv_heads, 128, cfg_ref.head_dim)
    pos = np.broadcast_to(np.arange(t_prompt, dtype=np.int32), (b, t_prompt))
    _, out = llama.forward_logits(ref_t.params, cfg_ref, prompt, pos, cache)
    cache = out.cache.replace(lengths=np.array([t_prompt, 5], np.int32))
    parents = np.array([[-1, 0, 0, 1, 1, 2, 4], [-1, 0, 1, 2, 3, 4, 5]], np.int32)
    depth = np.array([[0, 1, 1, 2, 2, 2, 3], [0, 1, 2, 3, 4, 5, 6]], np.int32)
    tokens = rng.integers(0, 64, (b, n)).astype(np.int32)
    positions = np.asarray(cache.lengths)[:, None] + depth
    lr, o_r = llama.forward_logits(ref_t.params, cfg_ref, tokens, positions, cache, parents)
    lp, o_p = llama.forward_logits(ref_t.params, cfg_pal, tokens, positions, cache, parents)
    assert np.abs(np.asarray(lr) - np.asarray(lp)).max() < 1e-4
    np.testing.assert_allclose(np.asarray(o_r.cache.k), np.asarray(o_p.cache.k), atol=1e-5)


def test_generate_with_pallas_equals_reference():
    tgt = tiny_target()
    pal = tiny_target()
    pal.config = pal.config.replace(attention_impl="pallas")
    prompts = [[5, 9, 2, 44, 13], [7, 1]]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=10)]
    assert [r.token_ids for r in generate(pal, prompts, max_new_tokens=10)] == ref
