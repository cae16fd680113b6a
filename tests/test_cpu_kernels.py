"""The CPU kernels for the target's and the feature drafters' layers (hsd_jax.cpu_kernels): the
matmul equal to XLA's dot, the tree attention equal to `tree_attention_reference`, the draft
head equal to its dot, all used by `generate` with the same tokens, and a clean fallback when
they cannot be built."""
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import api, cpu_kernels, engine, generate, load_drafter
from hsd_jax.cache import init_cache
from hsd_jax.models import drafter as dmod
from hsd_jax.models import llama
from pallas_kernels.tree_attention import ancestor_mask, tree_attention_reference
from tests.helpers import tiny_target

built = pytest.mark.skipif(not cpu_kernels.enabled(), reason="the CPU kernel could not be built here")


@built
def test_stacked_matmul_equals_the_dot_for_every_row_count_and_layer():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (3, 64, 96)).astype(np.float32)
    packed = jnp.asarray(cpu_kernels.pack(w))
    run = jax.jit(cpu_kernels.stacked_matmul)
    for n in (1, 2, 3, 5, 8, 9, 11, 12, 13, 16):
        x = rng.normal(0, 1, (n, 64)).astype(np.float32)
        for layer in range(3):
            np.testing.assert_allclose(np.asarray(run(x, packed, layer)), x @ w[layer], rtol=1e-5, atol=1e-5)
        active = rng.random(n) < 0.5                 # only these rows computed, the others 0
        np.testing.assert_allclose(np.asarray(run(x, packed, 2, active)), np.where(active[:, None], x @ w[2], 0),
                                   rtol=1e-5, atol=1e-5)



def _pairs_reference_check(run, rng):
    """`run(x, packed, layer, active)` on `pack_pairs` weights equals the float64 product of the bf16
    values (x rounded to bf16), for odd and even d, every row count and layer, inactive rows 0."""
    for d in (64, 77):
        w = rng.normal(0, 0.05, (2, d, 96)).astype(np.float32)
        packed = jnp.asarray(cpu_kernels.pack_pairs(w))
        assert packed.shape == (2, 3, (d + 1) // 2, 64) and packed.dtype == jnp.bfloat16
        wb = np.asarray(jnp.asarray(w).astype(jnp.bfloat16), np.float64)
        for n in (1, 3, 4, 8, 9, 12, 16):
            x = rng.normal(0, 1, (n, d)).astype(np.float32)
            xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
            active = rng.random(n) < 0.7
            for layer in range(2):
                want = np.where(active[:, None], xb @ wb[layer], 0)
                np.testing.assert_allclose(np.asarray(run(x, packed, layer, active)), want, rtol=1e-5, atol=1e-5)


@built
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, "pairs"])
def test_a_row_comes_out_the_same_bits_at_every_row_count(dtype):
    """Each row's sums run in one order whatever register tile holds it (8 rows, 12 in a verify-sized
    forward, the rest of a wider one), prefetched or not: a verify row equals its decode row bit for bit."""
    rng = np.random.default_rng(11)
    w = rng.normal(0, 0.05, (2, 96, 64)).astype(np.float32)
    packed = jnp.asarray(cpu_kernels.pack_pairs(w) if dtype == "pairs" else cpu_kernels.pack(w, dtype))
    x = rng.normal(0, 1, (40, 96)).astype(np.float32)
    one = np.stack([np.asarray(cpu_kernels.stacked_matmul(x[i:i + 1], packed, 1))[0] for i in range(40)])
    for n in (2, 6, 8, 9, 11, 12, 13, 20, 40):
        np.testing.assert_array_equal(np.asarray(cpu_kernels.stacked_matmul(x[:n], packed, 1)), one[:n])


@built
def test_the_pairs_layout_equals_the_bf16_product():
    """The head screen's layout (AVX-512 BF16 dot products where the CPU has them)."""
    _pairs_reference_check(jax.jit(cpu_kernels.stacked_matmul), np.random.default_rng(5))


def _matmul_built_with(path, *flags: str):
    """stacked_matmul.cc alone, built at `path` with the build's flags and `flags` after them, loaded."""
    import ctypes

    from hsd_jax import kernel_build

    src = os.path.join(kernel_build.HERE, "stacked_matmul.cc")
    subprocess.run(["g++", *kernel_build.FLAGS, *flags, f"-I{kernel_build.include_dir()}", "-shared", src, "-o",
                    str(path)], check=True, capture_output=True, timeout=300)
    return ctypes.cdll.LoadLibrary(str(path))


def _pairs_of(lib, name: str):
    """`run(x, packed, layer, active)` on `lib`'s pairs-layout matmul, registered as FFI target `name`."""
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.StackedMatmulPairsBF16), platform="cpu")

    def run(x, packed, layer, active):
        return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x.shape[0], packed.shape[1] * 32), jnp.float32))(
            jnp.asarray(x), packed, jnp.asarray([layer], jnp.int32), jnp.asarray(active, jnp.int32))

    return run


@built
def test_the_pairs_layout_without_bf16_dot_products_widens_to_the_same_product(tmp_path):
    """The same kernel built without AVX-512 BF16 and AMX (the path other CPUs take) gives the same products."""
    lib = _matmul_built_with(tmp_path / "widened.so", "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16")
    assert lib.HsdBF16DotProducts() == 0 and lib.HsdAmxTiles() == 0
    _pairs_reference_check(_pairs_of(lib, "hsd_test_pairs_widened"), np.random.default_rng(6))


@pytest.mark.skipif(not cpu_kernels.bf16_dot_products(), reason="no kernel, or this CPU has no AVX-512 BF16")
def test_the_pairs_layout_without_amx_takes_avx512_bf16_to_the_same_product(tmp_path):
    """Built without AMX (AVX-512 BF16 dot products, the path before Sapphire Rapids), the screen's layout
    gives the bf16 product too; where the CPU has AMX, this machine's build runs it
    (`test_the_pairs_layout_equals_the_bf16_product`)."""
    lib = _matmul_built_with(tmp_path / "no_amx.so", "-mno-amx-tile", "-mno-amx-bf16")
    assert lib.HsdBF16DotProducts() == 1 and lib.HsdAmxTiles() == 0
    _pairs_reference_check(_pairs_of(lib, "hsd_test_pairs_avx512"), np.random.default_rng(8))


def _packed_dot_check(run_dot, run_widen, run_pairs):
    """The packed bf16 layout with `dot_products` (a bf16 prefill's): from DOT_MIN_ROWS active rows the
    pairs layout's products bit for bit (the same AVX-512 BF16 dot products, pairs made in registers;
    `run_pairs` None: a build without them, the widening kernel's), below them the widening kernel's;
    odd d, several layers, inactive rows 0 and not counted."""
    rng = np.random.default_rng(12)
    for d in (64, 77):
        w = rng.normal(0, 0.05, (2, d, 96)).astype(np.float32)
        packed, pairs = jnp.asarray(cpu_kernels.pack(w, jnp.bfloat16)), jnp.asarray(cpu_kernels.pack_pairs(w))
        wb = np.asarray(jnp.asarray(w).astype(jnp.bfloat16), np.float64)
        for n, n_active in ((8, 8), (30, 23), (30, 24), (40, 40)):
            x = np.asarray(jnp.asarray(rng.normal(0, 1, (n, d)), jnp.bfloat16), np.float32)   # bf16 values
            active = np.zeros(n, bool)
            active[rng.permutation(n)[:n_active]] = True
            got = np.asarray(run_dot(x, packed, 1, active))
            np.testing.assert_allclose(got, np.where(active[:, None], x @ wb[1], 0), rtol=1e-5, atol=1e-5)
            same = run_pairs(x, pairs, 1, active) if run_pairs and n_active >= cpu_kernels.DOT_MIN_ROWS \
                else run_widen(x, packed, 1, active)
            np.testing.assert_array_equal(got, np.asarray(same))


@pytest.mark.skipif(not cpu_kernels.bf16_dot_products(), reason="no kernel, or this CPU has no AVX-512 BF16")
def test_the_packed_bf16_layout_takes_dot_products_from_enough_rows():
    dot = jax.jit(lambda x, w, layer, active: cpu_kernels.stacked_matmul(x, w, layer, active, dot_products=True))
    plain = jax.jit(cpu_kernels.stacked_matmul)
    _packed_dot_check(dot, plain, plain)


@built
def test_the_packed_bf16_dot_products_without_avx512_bf16_widen(tmp_path):
    """Built without AVX-512 BF16 (other CPUs), the prefill's target is the widening kernel, bit for bit."""
    lib = _matmul_built_with(tmp_path / "no_bf16.so", "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16")
    assert lib.HsdBF16DotProducts() == 0

    def target(symbol, name):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return lambda x, w, layer, active: jax.ffi.ffi_call(
            name, jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * 32), jnp.float32))(
            jnp.asarray(x), w, jnp.asarray([layer], jnp.int32), jnp.asarray(active, jnp.int32))

    _packed_dot_check(target("StackedMatmulPackedDotBF16", "hsd_test_dot_widened"),
                      target("StackedMatmulPackedBF16", "hsd_test_bf16_widened"), None)


def test_the_prefetch_level_follows_the_cpu_vendor_and_keys_the_library(monkeypatch):
    """prefetcht1 from one row on Intel, prefetchnta from two rows elsewhere (f32 tiles of 5+ rows and the
    pairs layout's from 4 into L2) and one-row bf16 tiles' own prefetch (stacked_matmul.cc): a build for
    one vendor is never loaded on another's machine."""
    from hsd_jax import kernel_build

    paths = {}
    for vendor, level, rows, ahead, l2, pairs in (("GenuineIntel", 2, 1, 0, 0, (0, 2)), ("AuthenticAMD", 0, 2, 256, 5, (64, 4)),
                                                  ("", 0, 2, 256, 5, (64, 4))):
        monkeypatch.setattr(kernel_build, "_vendor", lambda v=vendor: v)
        assert kernel_build.defines() == (f"-DHSD_PREFETCH_LOCALITY={level}", f"-DHSD_PREFETCH_MIN_ROWS={rows}",
                                          f"-DHSD_BF16_ROW1_AHEAD={ahead}", f"-DHSD_F32_L2_MIN_ROWS={l2}",
                                          f"-DHSD_PAIRS_AHEAD={pairs[0]}", f"-DHSD_PAIRS_MIN_ROWS={pairs[1]}")
        paths[vendor] = kernel_build.library_path()
    assert paths["GenuineIntel"] != paths["AuthenticAMD"] == paths[""]


@built
def test_the_other_vendors_prefetch_level_gives_the_same_products(tmp_path):
    """The matmul built with the prefetch settings this machine does not use (the other vendor's level and
    fewest rows; f32, bf16 and pairs tiles, 1-16 rows, the prefetching paths included) equals this machine's build."""
    from hsd_jax import kernel_build

    other = "AuthenticAMD" if kernel_build._vendor() == "GenuineIntel" else "GenuineIntel"
    ahead, least = kernel_build.pairs_ahead(other)
    lib = _matmul_built_with(tmp_path / "other_level.so", f"-DHSD_PREFETCH_LOCALITY={kernel_build.prefetch_locality(other)}",
                             f"-DHSD_PREFETCH_MIN_ROWS={kernel_build.prefetch_min_rows(other)}",
                             f"-DHSD_BF16_ROW1_AHEAD={kernel_build.bf16_row1_ahead(other)}",
                             f"-DHSD_F32_L2_MIN_ROWS={kernel_build.f32_l2_min_rows(other)}",
                             f"-DHSD_PAIRS_AHEAD={ahead}", f"-DHSD_PAIRS_MIN_ROWS={least}")
    rng = np.random.default_rng(7)
    w = rng.normal(0, 0.05, (2, 64, 96)).astype(np.float32)
    for dtype, symbol in ((jnp.float32, "StackedMatmulPacked"), (jnp.bfloat16, "StackedMatmulPackedBF16"),
                          ("pairs", "StackedMatmulPairsBF16")):
        name = f"hsd_test_level_{dtype if dtype == 'pairs' else np.dtype(dtype).name}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        packed = jnp.asarray(cpu_kernels.pack_pairs(w) if dtype == "pairs" else cpu_kernels.pack(w, dtype))
        for n in (1, 2, 5, 8, 11, 16):
            x = rng.normal(0, 1, (n, 64)).astype(np.float32)
            got = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((n, 96), jnp.float32))(
                jnp.asarray(x), packed, jnp.asarray([1], jnp.int32), jnp.ones((n,), jnp.int32))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(cpu_kernels.stacked_matmul(x, packed, 1)))


@built
@pytest.mark.parametrize("head_dim,hq,hkv", [(16, 4, 2), (64, 9, 3), (96, 4, 2), (128, 2, 1)])
def test_tree_attention_equals_the_reference(head_dim, hq, hkv):
    """Trees and chains of 1-17 new tokens over per-sequence prefixes (one of them filling the cache
    to the last slot, one with new tokens past the capacity), on layer 1 of a 3-layer stack."""
    rng = np.random.default_rng(head_dim)
    b, s, layers = 3, 40, 3
    run = jax.jit(cpu_kernels.tree_attention, static_argnames=("scale", "token_major"))
    for n in (1, 2, 5, 17):
        parents = np.stack([np.arange(n) - 1, rng.integers(-1, np.arange(n)), np.maximum(np.arange(n) - 2, -1)])
        parents = jnp.asarray(parents, jnp.int32)
        lengths = jnp.asarray([0, s - n, s - 2], jnp.int32)        # empty, full to the last slot, overflowing
        k = rng.normal(0, 1, (layers, b, hkv, s, head_dim)).astype(np.float32)
        v = rng.normal(0, 1, (layers, b, hkv, s, head_dim)).astype(np.float32)
        q = rng.normal(0, 1, (b, hq, n, head_dim)).astype(np.float32)
        got = run(q, k, v, 1, lengths, ancestor_mask(parents), scale=head_dim ** -0.5)
        want = tree_attention_reference(q, k[1], v[1], lengths, parents)
        in_cache = (np.asarray(lengths)[:, None] + np.arange(n) < s)[:, None, :, None]   # rows whose K/V fit
        np.testing.assert_allclose(np.where(in_cache, got, 0), np.where(in_cache, want, 0), rtol=2e-5, atol=2e-5)
        assert np.isfinite(np.asarray(got)).all()
        # a query that is not its own ancestor is skipped (0); the others as before
        active = jnp.asarray(rng.random((b, n)) < 0.5)
        part = run(q, k, v, 1, lengths, ancestor_mask(parents) & active[:, :, None], scale=head_dim ** -0.5)
        keep = np.asarray(active)[:, None, :, None]
        np.testing.assert_allclose(np.asarray(part), np.where(keep, np.asarray(got), 0), rtol=1e-6, atol=1e-6)
        # token-major q and output ([B, N, Hq, Dh], as the layers call it): the same bits, transposed
        for anc, ref in ((ancestor_mask(parents), got), (ancestor_mask(parents) & active[:, :, None], part)):
            tm = run(q.transpose(0, 2, 1, 3), k, v, 1, lengths, anc, scale=head_dim ** -0.5, token_major=True)
            np.testing.assert_array_equal(np.asarray(tm), np.asarray(ref).transpose(0, 2, 1, 3))


def kernel_calls(texts) -> int:
    """Matmul kernel calls (f32 and bf16 weights, either layout) in compiled programs' text."""
    return sum(txt.count('"hsd_stacked_matmul_packed') + txt.count('"hsd_stacked_matmul_pairs') for txt in texts)


@built
def test_generate_uses_the_kernel_with_the_same_tokens(monkeypatch):
    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True)    # head_dim 16 (attention) and the head screen
    d = load_drafter("hsd", target=t, random_init=True, seed=1)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (2, 9, 17)]
    # 3 x 5 verify rows: within the kernel screen's 16 (llama.SCREEN_KERNEL_MAX_ROWS)
    spec = dict(method="hsd", drafter=d, tree_nodes=4, tree_depth=3, tree_top_k=2)
    texts = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("HSD_CPU_KERNELS", flag)
        api._COMPILED.clear()
        ar = [r.token_ids for r in generate(t, prompts, max_new_tokens=24)]
        hsd = [r.token_ids for r in generate(t, prompts, max_new_tokens=24, **spec)]
        assert hsd == ar
        texts[flag] = (ar, [exe.as_text() for key, exe in api._COMPILED.items()   # the decode loops
                            if key[0] in (engine.ar_decode, engine.spec_decode)])
        # at T = 0 a prefill's first token comes from the certified screen too (XLA's f32 head copied the embedding)
        prefills = [exe.as_text() for key, exe in api._COMPILED.items() if key[0] in (engine.ar_prefill, engine.spec_prefill)]
        assert prefills and all(('"hsd_stacked_matmul_pairs_bf16"' in txt) == (flag == "1") for txt in prefills)
        # lookup nodes only after a 2-token match: the other rounds' lookup slots skipped on the kernels
        hybrid = generate(t, prompts, max_new_tokens=24, lookup_slots=2, lookup_min_match=2, **spec)
        assert [r.token_ids for r in hybrid] == ar
        assert all(0 < r.stats["lookup_rounds"] < r.stats["rounds"] for r in hybrid)
    assert texts["0"][0] == texts["1"][0]
    for target in cpu_kernels.TARGETS:       # quoted: one target's name is a prefix of another's
        assert all(f'"{target}"' not in txt for txt in texts["0"][1])
        if target not in ("hsd_tree_attention_bf16", "hsd_stacked_matmul_packed_bf16",    # bf16 targets': below
                          "hsd_stacked_matmul_packed_dot_bf16"):
            assert all(f'"{target}"' in txt for txt in texts["1"][1])     # decode and verify both run it
    # the drafter's layer and draft head run the kernel too: the same tokens, more kernel calls than
    # with the drafter's params as loaded (the target's alone)
    packed = api.serving_drafter_params(d, t)["packed_kernels"]
    assert {"q_proj", "mlp/down_proj", "draft_head", "readout_w1", "readout_w2"} <= set(packed)
    assert packed["draft_head"].shape == (1, len(d.d2t) // cpu_kernels.COLS, 64, cpu_kernels.COLS)
    # drafts in bf16 by default (half the bytes; acceptance, never the output, may move), f32 on request
    assert {a.dtype for a in packed.values()} == {jnp.dtype(api.DRAFTER_KERNEL_DTYPE)} == {jnp.dtype(jnp.bfloat16)}
    exact = api.serving_drafter_params(d, t, "float32")["packed_kernels"]
    assert {a.dtype for a in exact.values()} == {jnp.dtype(jnp.float32)} and set(exact) == set(packed)
    with monkeypatch.context() as m:
        m.setattr(api, "DRAFTER_KERNEL_DTYPE", "float32")
        assert [r.token_ids for r in generate(t, prompts, max_new_tokens=24, **spec)] == texts["1"][0]
    with monkeypatch.context() as m:
        m.setattr(api, "serving_drafter_params", lambda drafter, target: drafter.params)
        api._COMPILED.clear()
        assert [r.token_ids for r in generate(t, prompts, max_new_tokens=24, **spec)] == texts["1"][0]
        target_only = kernel_calls(exe.as_text() for exe in api._COMPILED.values())
    api._COMPILED.clear()
    assert [r.token_ids for r in generate(t, prompts, max_new_tokens=24, **spec)] == texts["1"][0]
    assert kernel_calls(exe.as_text() for exe in api._COMPILED.values()) > target_only > 0


@built
def test_eagle3_runs_its_layer_and_head_on_the_kernels():
    """EAGLE-3's fc, layer projections, attention and head run the kernels when served (they ran XLA's
    dots and an attention over the whole cache capacity): in f32 the same numbers as its XLA forms, a
    chain and a tree; in bf16 (the default) the same tokens, as every draft's numerics only move acceptance."""
    from hsd_jax.models import eagle3

    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True)    # head size 16: the attention kernel
    d = load_drafter("eagle3", target=t, random_init=True, seed=2)
    f32 = api.serving_drafter_params(d, t, "float32")
    assert set(f32["packed_kernels"]) == set(eagle3.PACKED)
    assert {a.dtype for a in api.serving_drafter_params(d, t)["packed_kernels"].values()} == {jnp.dtype(jnp.bfloat16)}
    cfg, rng = d.config, np.random.default_rng(6)
    layers, kv_heads, head_dim = cfg.cache_shape
    cache = init_cache(layers, 2, kv_heads, 32, head_dim).replace(lengths=jnp.array([5, 9], jnp.int32))
    cache = cache.replace(k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                          v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32))
    hidden = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    emb = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    pos = cache.lengths[:, None] + jnp.arange(4)[None]
    layer = jax.jit(eagle3.layer, static_argnums=1)
    for parents in (None, jnp.asarray([[-1, 0, 0, 1]] * 2, jnp.int32)):
        want, wcache = layer(d.params, cfg, hidden, emb, pos, cache, parents)
        got, gcache = layer(f32, cfg, hidden, emb, pos, cache, parents)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(gcache.k), np.asarray(wcache.k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(eagle3.logits, static_argnums=1)(f32, cfg, hidden, emb)),
                               np.asarray(eagle3.logits(d.params, cfg, hidden, emb)), rtol=1e-4, atol=1e-4)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 11)]
    ar = [r.token_ids for r in generate(t, prompts, max_new_tokens=20)]
    assert [r.token_ids for r in generate(t, prompts, max_new_tokens=20, method="eagle3", drafter=d)] == ar


@built
def test_a_forward_skips_its_inactive_tokens_on_the_kernels():
    """`active`: the tokens no active one sees (here unreachable slots after a 4-node tree) are not
    computed, the others come out as in the full forward; without the kernels all are computed."""
    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True)
    cfg, b, n = t.config, 2, 6
    rng = np.random.default_rng(5)
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, 32, cfg.head_dim)
    prompt = jnp.asarray(rng.integers(0, 64, (b, 7)), jnp.int32)
    full = api.serving_params(t)
    cache = llama.forward(full, cfg, prompt, jnp.broadcast_to(jnp.arange(7), (b, 7)), cache).cache.replace(
        lengths=jnp.full((b,), 7, jnp.int32))
    parents = jnp.asarray([[-1, 0, 0, 1, -1, -1]] * b, jnp.int32)
    tokens = jnp.asarray(rng.integers(0, 64, (b, n)), jnp.int32)
    pos = 7 + jnp.asarray([[0, 1, 1, 2, 0, 0]] * b, jnp.int32)
    active = jnp.broadcast_to(jnp.arange(n) < 4, (b, n))
    run = jax.jit(llama.forward, static_argnums=1)
    want = run(full, cfg, tokens, pos, cache, parents).features
    got = run(full, cfg, tokens, pos, cache, parents, active).features
    np.testing.assert_allclose(np.asarray(got[:, :4]), np.asarray(want[:, :4]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(got[:, 4:]), np.asarray(want[:, 4:]), atol=1e-2)   # not computed
    plain = run(t.params, cfg, tokens, pos, cache, parents, active).features   # XLA: every token computed
    np.testing.assert_allclose(np.asarray(plain), np.asarray(want), rtol=1e-4, atol=1e-4)


@built
def test_the_draft_head_through_the_kernel_equals_its_dot():
    t = tiny_target(vocab=96, hidden=64, tie_word_embeddings=True)
    d2t = np.random.default_rng(3).permutation(96)[:64].astype(np.int32)
    view = dmod.target_view(t.params, t.config, d2t)
    kview = view._replace(packed_head=dmod.pack_draft_head(t.params, t.config, d2t))
    h = jnp.asarray(np.random.default_rng(4).normal(0, 1, (2, 40, 64)), jnp.float32)   # 80 rows: XLA's dot
    for x in (h[0, :1], h[:, :3], h[0], h):
        np.testing.assert_allclose(np.asarray(jax.jit(dmod.draft_logits)(kview, x)),
                                   np.asarray(dmod.draft_logits(view, x)), rtol=1e-5, atol=1e-5)
    assert dmod.pack_draft_head(t.params, t.config, d2t[:40]) is None   # not whole column tiles: XLA's dot


@built
def test_the_fused_readout_through_the_kernel_equals_its_dots():
    """The fused read-out's two matmuls on their packed copies (a served drafter's): in f32 the numbers of
    XLA's dots at decode sizes (1-3 rows, a path-token context too); 80 rows and unpacked params: the dots."""
    t = tiny_target(vocab=96, hidden=64, tie_word_embeddings=True)
    d = load_drafter("hsd", target=t, random_init=True, seed=3)
    cfg = d.config
    rng = np.random.default_rng(8)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.1, a.shape), a.dtype), d.params)  # w2 is 0 at init
    view = dmod.target_view(t.params, t.config, d.d2t)
    packed = dmod.pack_readout(params["inject"], jnp.float32)
    assert {k: v.shape for k, v in packed.items()} == {
        "readout_w1": (1, cfg.mlp_hidden // cpu_kernels.COLS, 128, cpu_kernels.COLS),
        "readout_w2": (1, 64 // cpu_kernels.COLS, cfg.mlp_hidden, cpu_kernels.COLS)}
    served = dict(params, packed_kernels=packed)
    run = jax.jit(dmod.readout, static_argnums=1)
    g = jnp.asarray(rng.normal(0, 3, (2, 40, 64)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 96, (2, 40)), jnp.int32)
    for sl in (np.s_[0, :1], np.s_[:, :3], np.s_[:]):     # 1, 6 and 80 rows
        want = dmod.readout(params, cfg, view, g[sl], tokens[sl])
        got = run(served, cfg, view, g[sl], tokens[sl])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    texts = [run.lower(p, cfg, view, g[:, :3], tokens[:, :3]).as_text() for p in (served, params)]
    assert texts[0].count("hsd_stacked_matmul_packed") == 2 and "hsd_stacked_matmul" not in texts[1]


def test_a_failed_build_falls_back_to_xla_with_one_warning(tmp_path):
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from hsd_jax import cpu_kernels, generate\n"
            "from tests.helpers import tiny_target\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    on = cpu_kernels.enabled(); cpu_kernels.enabled()\n"
            "    out = generate(tiny_target(vocab=64), [[1, 2, 3]], max_new_tokens=5)[0].token_ids\n"
            "print(on, len(out), sum('CPU kernel unavailable' in str(x.message) for x in w))\n")
    env = dict(os.environ, CXX="/bin/false", HSD_JAX_CACHE=str(tmp_path), JAX_PLATFORMS="cpu", HSD_CPU_KERNELS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "5", "1"]


@built
def test_bf16_weights_and_cache_on_the_kernels_equal_a_float64_reference():
    """bf16 weights (packed as they are) and a bf16 KV cache: widened exactly, so the matmul is the
    float64 product of the bf16 values up to f32 summation, and the attention is the reference's
    over the widened cache."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(0, 0.05, (3, 64, 96)), jnp.bfloat16)
    packed = jnp.asarray(cpu_kernels.pack(w, w.dtype))
    assert packed.dtype == jnp.bfloat16
    x = jnp.asarray(rng.normal(0, 1, (9, 64)), jnp.bfloat16)
    got = np.asarray(jax.jit(cpu_kernels.stacked_matmul)(x, packed, 2))
    want = np.asarray(x, np.float64) @ np.asarray(w[2], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    b, s, hq, hkv, dh, n = 2, 40, 4, 2, 64, 5
    k = jnp.asarray(rng.normal(0, 1, (3, b, hkv, s, dh)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(0, 1, (3, b, hkv, s, dh)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(0, 1, (b, hq, n, dh)), jnp.bfloat16)
    parents = jnp.asarray([np.arange(n) - 1, [-1, 0, 0, 1, 1]], jnp.int32)
    lengths = jnp.asarray([3, 20], jnp.int32)
    got = jax.jit(cpu_kernels.tree_attention, static_argnames="scale")(q, k, v, 1, lengths, ancestor_mask(parents),
                                                                       scale=dh ** -0.5)
    f32 = lambda a: a.astype(jnp.float32)
    want = tree_attention_reference(f32(q), f32(k[1]), f32(v[1]), lengths, parents)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@built
def test_a_bf16_target_runs_the_kernels_and_every_method_gives_bf16_ar():
    """A bf16 target's layers, attention and LM head (`packed_kernels["head"]`) on the kernels:
    its logits are the bf16 model's (XLA's bf16 path within bf16 rounding; a bf16 cache here, on the
    bf16 attention kernel), and every method's greedy tokens equal bf16 ar's."""
    t = tiny_target(vocab=96, hidden=64, tie_word_embeddings=True, dtype="bfloat16")
    params = api.serving_params(t)
    packed = params["packed_kernels"]
    assert packed["q_proj"].dtype == packed["head"].dtype == jnp.bfloat16 and "head_screen" not in packed
    cfg = t.config
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 96, (2, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    cache = init_cache(cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim, jnp.bfloat16)

    @jax.jit
    def logits(p):
        return llama.serving_logits(p, cfg, llama.forward(p, cfg, tokens, pos, cache).features)

    got, want = logits(params), logits(t.params)      # the kernels, XLA's bf16 dots
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05 * scale)
    # a row's bits do not depend on the row count (the norms too: `cpu_kernels.rms_norm`)
    run = jax.jit(lambda p, tk, ps: llama.serving_logits(p, cfg, llama.forward(p, cfg, tk, ps, cache).features))
    long = jnp.asarray(rng.integers(0, 96, (2, 12)), jnp.int32)
    rows = [np.asarray(run(params, long[:, :n], jnp.broadcast_to(jnp.arange(n), (2, n))))[:, 0] for n in (1, 5, 12)]
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[0], rows[2])
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (3, 11, 70)]    # 70: a prefill past MAX_ROWS
    d = load_drafter("hsd", target=t, random_init=True, seed=1)
    api._COMPILED.clear()
    ar = [r.token_ids for r in generate(t, prompts, max_new_tokens=16)]
    for spec in (dict(method="hsd", drafter=d, tree_nodes=4, tree_depth=3, tree_top_k=2),
                 dict(method="lookup", drafter=load_drafter("lookup", target=t), gamma=4),
                 dict(method="eagle3", drafter=load_drafter("eagle3", target=t, random_init=True, seed=2))):
        assert [r.token_ids for r in generate(t, prompts, max_new_tokens=16, **spec)] == ar
    texts = [exe.as_text() for exe in api._COMPILED.values()]
    # bf16 layers and head; an f32 cache holding the bf16 K/V exactly (`llama.cache_dtype`)
    assert any('"hsd_stacked_matmul_packed_bf16"' in txt and '"hsd_tree_attention"' in txt for txt in texts)
    # the prefills' layers ask for dot products (taken from DOT_MIN_ROWS rows: the 70-token prompt's), no
    # decode loop does: its steps and verifies keep one arithmetic for a row at any row count
    dot = '"hsd_stacked_matmul_packed_dot_bf16"'
    loops = [exe.as_text() for key, exe in api._COMPILED.items() if key[0] in (engine.ar_decode, engine.spec_decode)]
    assert loops and not any(dot in txt for txt in loops) and sum(dot in txt for txt in texts) >= 4
    # the norms' column of ones is a literal, not a splat XLA broadcasts again at every layer call
    splat = re.compile(r"f32\[1,1,64,32\]\S* broadcast\(")
    assert not [txt for txt in loops if splat.search(txt)]
    assert llama.cache_dtype(params, cfg) == jnp.float32 and llama.cache_dtype(t.params, cfg) == jnp.bfloat16
    # the embedding's rows gathered as bf16 bits (`layers.take`): no program widens the whole table to f32
    # (XLA:CPU's bf16 gather did, once per call, hoisted out of the loop)
    widened = re.compile(r"f32\[(96,64|64,96)\]\S* convert\(")
    assert not [txt for txt in texts if widened.search(txt)]


@built
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_tree_row_equals_its_accepted_path_bit_for_bit(dtype):
    """Tree node 3 (path 0 -> 2 -> 3, its K/V at slots L, L + 2, L + 3) and the same path as a chain
    after commit (slots L, L + 1, L + 2): the same attention output exactly, so a method's verify
    and ar's decode steps agree to the bit (a bf16 model would round a difference to a bf16 ulp)."""
    rng = np.random.default_rng(11)
    b, hq, hkv, dh, s, length = 1, 4, 2, 64, 48, 21
    k = rng.normal(0, 1, (1, b, hkv, s, dh)).astype(np.float32)
    v = rng.normal(0, 1, (1, b, hkv, s, dh)).astype(np.float32)
    q = rng.normal(0, 3, (b, hq, 4, dh)).astype(np.float32)
    run = jax.jit(cpu_kernels.tree_attention, static_argnames="scale")
    lengths = jnp.asarray([length], jnp.int32)
    tree = run(q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), 0, lengths,
               ancestor_mask(jnp.asarray([[-1, 0, 0, 2]], jnp.int32)), scale=dh ** -0.5)
    path = [length, length + 2, length + 3]
    kc, vc = k.copy(), v.copy()
    kc[:, :, :, length:length + 3], vc[:, :, :, length:length + 3] = k[:, :, :, path], v[:, :, :, path]
    chain = run(q[:, :, [0, 2, 3]], jnp.asarray(kc, dtype), jnp.asarray(vc, dtype), 0, lengths,
                ancestor_mask(jnp.asarray([[-1, 0, 1]], jnp.int32)), scale=dh ** -0.5)
    np.testing.assert_array_equal(np.asarray(tree)[:, :, [0, 2, 3]], np.asarray(chain))


@built
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_row_is_the_same_however_the_verify_splits_into_tasks(dtype):
    """SmolLM2's heads (9 query, 3 kv): a verify of m new tokens is one task per kv head up to 8 rows
    a group and row chunks beyond (17 tokens: 51 rows a group), yet each row of the first m tree nodes
    gives, bit for bit, what the 17-token verify gives it: how a task splits its rows never changes a
    row's arithmetic (prefix lengths 0 and 37 give full and partial last blocks)."""
    rng = np.random.default_rng(5)
    b, hq, hkv, dh, s, n = 2, 9, 3, 64, 64, 17
    k = jnp.asarray(rng.normal(0, 1, (2, b, hkv, s, dh)), dtype)
    v = jnp.asarray(rng.normal(0, 1, (2, b, hkv, s, dh)), dtype)
    q = rng.normal(0, 2, (b, hq, n, dh)).astype(np.float32)
    parents = jnp.asarray(np.stack([rng.integers(-1, np.arange(n)), np.arange(n) - 1]), jnp.int32)
    lengths = jnp.asarray([37, 0], jnp.int32)
    run = jax.jit(cpu_kernels.tree_attention, static_argnames="scale")
    full = np.asarray(run(q, k, v, 1, lengths, ancestor_mask(parents), scale=dh ** -0.5))
    for m in (1, 2, 3, 5, 9):
        part = run(q[:, :, :m], k, v, 1, lengths, ancestor_mask(parents[:, :m]), scale=dh ** -0.5)
        np.testing.assert_array_equal(np.asarray(part), full[:, :, :m])



@built
def test_a_prefill_runs_the_kernels_up_to_max_prefill_rows(monkeypatch):
    """A 70-token prompt (past MAX_ROWS) prefills on the matmul and attention kernels, each row seeing
    only its causal prefix: its last token's logits match XLA's dots; past MAX_PREFILL_ROWS, XLA's."""
    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True)
    cfg = t.config
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (1, 70)), jnp.int32)
    lens = jnp.asarray([70], jnp.int32)

    def run(params):
        fn = jax.jit(lambda p, x, n: llama.prefill_new_cache(p, cfg, x, n, 96)[0])
        return np.asarray(fn(params, tokens, lens)), fn.lower(params, tokens, lens).compile().as_text()

    want, xla = run(t.params)
    got, kernels = run(api.serving_params(t, ready=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert '"hsd_tree_attention"' in kernels and kernel_calls([kernels]) > 0 and kernel_calls([xla]) == 0
    monkeypatch.setattr(cpu_kernels, "MAX_PREFILL_ROWS", 64)
    assert kernel_calls([run(api.serving_params(t, ready=True))[1]]) == 0


@built
def test_a_prefill_skips_its_bucket_padding_on_the_kernels():
    """A 70-token prompt right-padded to its 128-token bucket: the kernels skip the padding's rows (their
    K/V slots stay zero), and the last token's logits are the unpadded prefill's."""
    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True)
    cfg, params = t.config, api.serving_params(t, ready=True)
    ids = np.random.default_rng(4).integers(0, 64, 70)
    run = jax.jit(lambda p, x, n: llama.prefill_new_cache(p, cfg, x, n, 160))
    lens = jnp.asarray([70], jnp.int32)
    exact, out_exact = run(params, jnp.asarray(ids[None], jnp.int32), lens)
    padded, out = run(params, jnp.asarray(np.pad(ids, (0, 58))[None], jnp.int32), lens)
    np.testing.assert_allclose(np.asarray(padded), np.asarray(exact), rtol=1e-6, atol=1e-6)
    k = np.asarray(out.cache.k)
    assert not k[:, :, :, 70:128].any() and k[:, :, :, :70].any()
    np.testing.assert_allclose(k[:, :, :, :70], np.asarray(out_exact.cache.k)[:, :, :, :70], rtol=1e-6, atol=1e-6)

