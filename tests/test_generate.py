"""Jitted AR generate: cache correctness, batching, stopping, sampling and input errors."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import api, engine, load_drafter
from hsd_jax.api import InputError, generate
from hsd_jax.config import ConfigError, SamplingConfig
from hsd_jax.sampling import processed_logits, sample
from tests.helpers import jax_logits, tiny_target


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def _naive_greedy(tgt, ids, n):
    """Greedy decoding by recomputing the full sequence every step (no KV cache). The sequence is
    padded to its final length (one compile): a causal forward's earlier positions never see it."""
    seq = list(ids)
    for _ in range(n):
        padded = seq + [0] * (len(ids) + n - len(seq))
        seq.append(int(np.argmax(jax_logits(tgt.params, tgt.config, [padded])[0, len(seq) - 1])))
    return seq[len(ids):]


def test_cached_greedy_equals_full_recompute(tiny):
    ids = [3, 17, 42, 5, 9]
    assert generate(tiny, [ids], max_new_tokens=12)[0].token_ids == _naive_greedy(tiny, ids, 12)


def test_batch_of_unequal_prompts_equals_one_by_one(tiny):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 17, 9, 30)]
    batched = generate(tiny, prompts, max_new_tokens=20)
    for p, r in zip(prompts, batched):
        assert r.token_ids == generate(tiny, [p], max_new_tokens=20)[0].token_ids
        assert len(r.token_ids) == 20 and r.stats["tau"] == 1.0


def test_eos_stops_each_sequence(tiny):
    ids = [1, 2, 3]
    free = generate(tiny, [ids], max_new_tokens=10)[0].token_ids
    eos = free[3]
    stop_at = free.index(eos)
    tgt = tiny_target()
    tgt.config = tgt.config.replace(eos_token_ids=(eos,))
    res = generate(tgt, [ids, [7, 7, 7, 7]], max_new_tokens=10)
    assert res[0].token_ids == free[: stop_at + 1]
    other = generate(tiny, [[7, 7, 7, 7]], max_new_tokens=10)[0].token_ids
    cut = other.index(eos) + 1 if eos in other else 10
    assert res[1].token_ids == other[:cut]


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny):
    ids = [4, 8, 15, 16, 23]
    a = generate(tiny, [ids], max_new_tokens=16, temperature=1.0, seed=3)[0].token_ids
    b = generate(tiny, [ids], max_new_tokens=16, temperature=1.0, seed=3)[0].token_ids
    c = generate(tiny, [ids], max_new_tokens=16, temperature=1.0, seed=4)[0].token_ids
    assert a == b and a != c
    greedy = generate(tiny, [ids], max_new_tokens=16)[0].token_ids
    assert generate(tiny, [ids], max_new_tokens=16, temperature=0.7, top_k=1, seed=5)[0].token_ids == greedy


def test_top_k_top_p_filters():
    logits = jnp.log(jnp.array([0.05, 0.4, 0.3, 0.15, 0.1]))
    k2 = processed_logits(logits, SamplingConfig(1.0, top_k=2))
    assert np.isfinite(np.asarray(k2)).tolist() == [False, True, True, False, False]
    p = processed_logits(logits, SamplingConfig(1.0, top_p=0.8))
    assert np.isfinite(np.asarray(p)).tolist() == [False, True, True, True, False]
    p = processed_logits(logits, SamplingConfig(1.0, top_p=0.7))
    assert np.isfinite(np.asarray(p)).tolist() == [False, True, True, False, False]


def test_sampler_matches_softmax_distribution():
    """Chi-square goodness of fit of 20k draws at T=0.8 (threshold: p > 1e-3 for 7 dof is chi2 < 24.3)."""
    logits = jnp.array([1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 0.8])
    cfg = SamplingConfig(temperature=0.8)
    keys = jax.random.split(jax.random.key(0), 20000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, cfg))(keys))
    expected = np.asarray(jax.nn.softmax(logits / 0.8)) * len(draws)
    observed = np.bincount(draws, minlength=8)
    assert ((observed - expected) ** 2 / expected).sum() < 24.3


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[[1] * 250], max_new_tokens=10), "exceeds the cache"),
    (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1, 99]]), "outside"),
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=[[1, 2]], method="nope"), "unknown method"),
])
def test_bad_generate_input_is_refused(tiny, kwargs, message):
    prompts = kwargs.pop("prompts")
    with pytest.raises(InputError, match=message):
        generate(tiny, prompts, **kwargs)


def test_bad_sampling_config_is_refused(tiny):
    with pytest.raises(ConfigError, match="top_p"):
        generate(tiny, [[1, 2]], temperature=1.0, top_p=0.0)


def test_tiny_models_compile_fast_and_large_ones_with_xla_defaults(tiny):
    from hsd_jax import api, cpu_kernels

    assert api.compile_options(tiny.params) == api.FAST_COMPILE_OPTIONS
    big = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    assert api.compile_options(big) == {}
    # served on the CPU kernels, a large model's programs skip what only XLA's own matmuls would repay
    assert api.compile_options(big, kernels=True) == (api.KERNEL_PROGRAM_OPTIONS if cpu_kernels.enabled() else {})
    wide_vocab = {"embed_tokens": {"embedding": jax.ShapeDtypeStruct((49152, 96), jnp.float32)}, "layers": {}}
    assert api.compile_options(wide_vocab) == api.FAST_COMPILE_OPTIONS   # the decoder's size decides
    # the fast options really reach XLA: the same loop compiled both ways gives the same tokens
    prompts = [[3, 9, 27], [5]]
    fast = generate(tiny, prompts, max_new_tokens=12)
    api._COMPILED.clear()
    try:
        api.SMALL_PROGRAM_PARAMS, saved = 0, api.SMALL_PROGRAM_PARAMS
        slow = generate(tiny, prompts, max_new_tokens=12)
        assert api.compile_options(tiny.params) == {}
    finally:
        api.SMALL_PROGRAM_PARAMS = saved
    assert [r.token_ids for r in fast] == [r.token_ids for r in slow]
    assert slow[0].stats["compile_seconds"] > 0


def test_initialisers_run_as_one_program_with_the_eager_bits():
    """`init_program`: a random initialiser compiled once (also nested in another's program) gives
    what running it op by op gives, up to float rounding (XLA fuses the scaling differently)."""
    from hsd_jax.config import ModelConfig
    from hsd_jax.models import drafter, llama

    cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    dcfg = drafter.DrafterConfig.for_target("hsd", cfg)
    key = jax.random.key(7)
    for fn, args in ((llama.init_params, (cfg, key, 0.3)), (drafter.init_drafter_params, (dcfg, key))):
        jitted, eager = fn(*args), fn.__wrapped__(*args)
        assert jax.tree.structure(jitted) == jax.tree.structure(eager)
        for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_the_decode_loops_take_their_cache_in_place(tiny):
    """The decode programs donate the prefill's output and hand its cache back: the loop writes the
    cache where the prefill left it (XLA copied a read-only input cache whole into the loop, 2 x 47 MB
    a call for SmolLM2 at capacity 2048), and a second call's answer is the same."""
    prompts = [[1, 2, 3, 4, 5]]
    api._COMPILED.clear()
    ar = [generate(tiny, prompts, max_new_tokens=6)[0].token_ids for _ in range(2)]
    drafter = load_drafter("hsd", target=tiny, random_init=True, seed=1)
    hsd = [generate(tiny, prompts, max_new_tokens=6, method="hsd", drafter=drafter)[0].token_ids for _ in range(2)]
    assert ar[0] == ar[1] == hsd[0] == hsd[1]
    cfg = tiny.config
    cache = re.compile(rf"f32\[{cfg.num_layers},1,{cfg.num_kv_heads},\d+,{cfg.head_dim}\]\S* copy\(%\w*pre")
    loops = [exe.as_text() for key, exe in api._COMPILED.items() if key[0] in (engine.ar_decode, engine.spec_decode)]
    assert len(loops) == 2
    for text in loops:
        assert "input_output_alias" in text and not cache.search(text)
