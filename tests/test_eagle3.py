"""EAGLE-3 in the published format: a random checkpoint written exactly as the EAGLE reference and
SpecForge publish one (config.json + model.safetensors, PyTorch [out, in] weights, d2t offsets) for
a small random LLaMA target; our draft logits against a PyTorch reference written from the
published architecture, greedy identity with ar, and the loader's refusals."""
import json
import os

import numpy as np
import pytest

from hsd_jax import generate, load_drafter, load_target
from hsd_jax.loading.errors import ModelLoadError
from tests.helpers import save_hf_dir, tiny_target

H, HEADS, KV, DH, INTER, VOCAB, VD, LAYERS = 32, 4, 2, 8, 48, 64, 40, 8
TINY = dict(h=H, heads=HEADS, kv=KV, dh=DH, inter=INTER, vocab=VOCAB, vd=VD)
SMOLLM2 = dict(h=576, heads=9, kv=3, dh=64, inter=64, vocab=49152, vd=256)   # a small MLP keeps the file small


def write_eagle3(path, *, dims=TINY, seed=0, aux_ids=None, extra_config=None, drop=(), target_hidden=None,
                 qk_norm=False):
    """A random EAGLE-3 drafter directory in the published layout; returns (draft->target ids, tensors).
    qk_norm: the Qwen3-style layer some SpecForge forks write (per-head q/k RMSNorm weights)."""
    from safetensors.numpy import save_file

    H, HEADS, KV, DH, INTER, VOCAB, VD = (dims[k] for k in ("h", "heads", "kv", "dh", "inter", "vocab", "vd"))
    th = target_hidden or H
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
    norm = lambda: (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32)
    ids = np.sort(rng.choice(VOCAB, VD, replace=False))
    t2d = np.zeros(VOCAB, bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": w(H, 3 * th), "midlayer.hidden_norm.weight": norm(), "midlayer.input_layernorm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(HEADS * DH, 2 * H), "midlayer.self_attn.k_proj.weight": w(KV * DH, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV * DH, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, HEADS * DH),
        "midlayer.mlp.gate_proj.weight": w(INTER, H), "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER), "norm.weight": norm(), "lm_head.weight": w(VD, H),
        "d2t": (ids - np.arange(VD)).astype(np.int64), "t2d": t2d,
    }
    if qk_norm:
        tensors.update({f"midlayer.self_attn.{k}.weight": (1.0 + 0.3 * rng.standard_normal(DH)).astype(np.float32)
                        for k in ("q_norm", "k_norm")})
    for k in drop:
        tensors.pop(k)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "intermediate_size": INTER,
              "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": VD, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    if HEADS * DH != H:
        config["head_dim"] = DH
    if qk_norm:
        config.update(architectures=["Qwen3ForCausalLMEagle3"], model_type="qwen3")
    if target_hidden:
        config["target_hidden_size"] = target_hidden
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    config.update(extra_config or {})
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return ids, tensors


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_target"))
    save_hf_dir(tiny_target(vocab=VOCAB, layers=LAYERS, heads=HEADS, kv_heads=KV, hidden=H, seed=3), path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, tokenizer=False, max_cache_len=128)


def torch_reference(target_dir, tensors, tokens, root, y, capture, dims=TINY, theta=10000.0, eps=1e-5):
    """Draft logits at every prompt position and one tree step deeper, from the published
    architecture in PyTorch: features captured at the inputs of target layers `capture`, fc,
    [input_layernorm(e(next token)); hidden_norm(g)] into attention (per-head q/k RMSNorm before
    RoPE when the tensors have them) with g as residual, MLP, lm_head(norm(h)); the deeper step
    feeds the last h back with token y."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    tgt = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    HEADS, KV, DH = dims["heads"], dims["kv"], dims["dh"]
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hs = tgt(ids, output_hidden_states=True).hidden_states   # hs[i]: the input of layer i
        g = torch.cat([hs[i] for i in capture], -1) @ t["fc.weight"].T
        nxt = torch.tensor([tokens[1:] + [root]])
        emb = tgt.model.embed_tokens(torch.cat([nxt, torch.tensor([[y]])], 1))

        def rms(x, wt):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

        def rope(x, pos):   # x [T, heads, Dh], rotate-half
            inv = 1.0 / (theta ** (torch.arange(0, DH, 2, dtype=torch.float32) / DH))
            ang = pos[:, None].float() * inv[None]
            cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
            rot = torch.cat([-x[..., DH // 2:], x[..., : DH // 2]], -1)
            return x * cos + rot * sin

        def midlayer(hidden, e):
            m = "midlayer."
            x = torch.cat([rms(e, t[m + "input_layernorm.weight"]), rms(hidden, t[m + "hidden_norm.weight"])], -1)
            n = x.shape[0]
            pos = torch.arange(n)
            q = (x @ t[m + "self_attn.q_proj.weight"].T).view(n, HEADS, DH)
            k = (x @ t[m + "self_attn.k_proj.weight"].T).view(n, KV, DH)
            if m + "self_attn.q_norm.weight" in t:
                q, k = rms(q, t[m + "self_attn.q_norm.weight"]), rms(k, t[m + "self_attn.k_norm.weight"])
            q, k = rope(q, pos), rope(k, pos)
            v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, KV, DH)
            k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
            att = torch.einsum("qhd,khd->hqk", q, k) / DH ** 0.5
            att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, HEADS * DH) @ t[m + "self_attn.o_proj.weight"].T
            h = hidden + o
            z = rms(h, t[m + "post_attention_layernorm.weight"])
            mlp = (torch.nn.functional.silu(z @ t[m + "mlp.gate_proj.weight"].T) * (z @ t[m + "mlp.up_proj.weight"].T))
            return h + mlp @ t[m + "mlp.down_proj.weight"].T

        def head(h):
            return rms(h, t["norm.weight"]) @ t["lm_head.weight"].T

        h = midlayer(g[0], emb[0, :-1])
        deeper = midlayer(torch.cat([g[0], h[-1:]], 0), emb[0])   # K/V of earlier positions depend on their inputs only
        return head(h).numpy(), head(deeper[-1:]).numpy()[0]


def ours(target, drafter, tokens, root, y):
    """The same two quantities through the engine's own pieces (prefill features, prompt pass, one step)."""
    import jax.numpy as jnp

    from hsd_jax.cache import init_cache
    from hsd_jax.models import eagle3, llama

    cfg = drafter.config
    tcfg = target.config.replace(feature_layers=cfg.feature_layers)
    n = len(tokens)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    out = llama.forward(target.params, tcfg, jnp.asarray([tokens], jnp.int32), pos,
                        init_cache(tcfg.num_layers, 1, tcfg.num_kv_heads, 64, tcfg.head_dim))
    table = target.params["embed_tokens"]["embedding"]
    emb = jnp.take(table, jnp.asarray([tokens[1:] + [root]]), axis=0)
    cache = init_cache(1, 1, cfg.num_kv_heads, 64, cfg.head_dim)
    h, cache = eagle3.layer(drafter.params, cfg, eagle3.fuse(drafter.params, out.aux_features), emb, pos, cache)
    cache = cache.replace(lengths=cache.lengths + n)
    deeper, _ = eagle3.layer(drafter.params, cfg, h[:, -1:], jnp.take(table, jnp.asarray([[y]]), axis=0),
                             jnp.asarray([[n]], jnp.int32), cache, jnp.asarray([[-1]], jnp.int32))
    return np.asarray(eagle3.logits(drafter.params, cfg, h))[0], np.asarray(eagle3.logits(drafter.params, cfg, deeper))[0, 0]


@pytest.mark.parametrize("aux_ids", [None, (0, 3, 6)])
def test_draft_logits_match_a_pytorch_reference_of_the_published_architecture(target, target_dir, tmp_path, aux_ids):
    ids, tensors = write_eagle3(str(tmp_path / "eagle3"), aux_ids=aux_ids)
    d = load_drafter("eagle3", str(tmp_path / "eagle3"), target=target)
    # default: the inputs of layers 2, L//2, L-3; explicit ids name layer outputs (inputs of id + 1)
    capture = (2, LAYERS // 2, LAYERS - 3) if aux_ids is None else tuple(i + 1 for i in aux_ids)
    assert d.config.feature_layers == tuple(i - 1 for i in capture)
    assert d.d2t.tolist() == ids.tolist()
    tokens, root, y = [5, 17, 3, 42, 8, 8, 21, 60, 1], 33, 12
    ref_prompt, ref_step = torch_reference(target_dir, tensors, tokens, root, y, capture)
    got_prompt, got_step = ours(target, d, tokens, root, y)
    np.testing.assert_allclose(got_prompt, ref_prompt, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(got_step, ref_step, rtol=2e-4, atol=2e-4)


def test_published_drafter_is_lossless_and_saves_in_our_format(target, tmp_path):
    from hsd_jax import save_drafter

    write_eagle3(str(tmp_path / "eagle3"), seed=1)
    d = load_drafter("eagle3", str(tmp_path / "eagle3"), target=target)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=int(n)).tolist() for n in (4, 9, 13)]
    ref = [r.token_ids for r in generate(target, prompts, max_new_tokens=20)]
    shape = dict(tree_nodes=8, tree_depth=4, tree_top_k=3)
    res = generate(target, prompts, max_new_tokens=20, method="eagle3", drafter=d, **shape)
    assert [r.token_ids for r in res] == ref
    assert all(r.stats["drafter_forwards"] > 0 for r in res)
    save_drafter(d, str(tmp_path / "ours"))
    again = load_drafter("eagle3", str(tmp_path / "ours"), target=target)
    assert again.config == d.config and again.d2t.tolist() == d.d2t.tolist()
    res2 = generate(target, prompts, max_new_tokens=20, method="eagle3", drafter=again, **shape)
    assert [r.token_ids for r in res2] == ref
    assert [r.stats["rounds"] for r in res2] == [r.stats["rounds"] for r in res]


def test_cli_generates_on_smollm2_with_a_published_eagle3_drafter(tmp_path, capsys, mt_prompts):
    """`hsd generate --method eagle3 --drafter PATH` on the embedded model: same text as ar."""
    from hsd_jax.cli import main

    write_eagle3(str(tmp_path / "eagle3"), dims=SMOLLM2, seed=2)
    base = ["generate", "--prompt", mt_prompts[0], "--chat", "--max-new-tokens", "12", "--max-cache-len", "256", "--json"]
    assert main(base) == 0
    ar = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(base + ["--method", "eagle3", "--drafter", str(tmp_path / "eagle3")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == "eagle3" and out["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) == 12
    assert out["drafter_forwards"] > 0


@pytest.mark.parametrize("case, text", [
    ("pickle", "never unpickles"),
    ("missing", "midlayer.self_attn.q_proj.weight is missing"),
    ("two_layers", "one decoder layer"),
    ("wrong_arch", "not an EAGLE-3 drafter"),
    ("wrong_target_width", "target features of width 48"),
    ("bad_d2t", "outside the target vocabulary"),
])
def test_bad_checkpoints_are_refused_clearly(target, tmp_path, case, text):
    path = str(tmp_path / case)
    if case == "pickle":
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLMEagle3"]}, f)
        open(os.path.join(path, "pytorch_model.bin"), "wb").close()
    elif case == "missing":
        write_eagle3(path, drop=("midlayer.self_attn.q_proj.weight",))
    elif case == "two_layers":
        write_eagle3(path, extra_config={"num_hidden_layers": 2})
    elif case == "wrong_arch":
        write_eagle3(path, extra_config={"architectures": ["MistralForCausalLM"]})
    elif case == "wrong_target_width":
        write_eagle3(path, target_hidden=48)
    else:
        from safetensors.numpy import load_file, save_file

        write_eagle3(path)
        t = load_file(os.path.join(path, "model.safetensors"))
        t["d2t"] = t["d2t"] + VOCAB
        save_file(t, os.path.join(path, "model.safetensors"))
    with pytest.raises((ModelLoadError, ValueError), match=text):
        load_drafter("eagle3", path, target=target)


def test_export_writes_the_published_format_back_exactly(target, tmp_path, capsys):
    """published -> load -> save_drafter (our format) -> `hsd export-eagle3` -> the same tensors."""
    from safetensors.numpy import load_file

    from hsd_jax import save_drafter
    from hsd_jax.cli import main

    _, tensors = write_eagle3(str(tmp_path / "published"), seed=4, aux_ids=(0, 3, 6))
    d = load_drafter("eagle3", str(tmp_path / "published"), target=target)
    save_drafter(d, str(tmp_path / "ours"))
    assert main(["export-eagle3", str(tmp_path / "ours"), str(tmp_path / "exported")]) == 0
    back = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    cfg = json.load(open(tmp_path / "exported" / "config.json"))
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6] and cfg["draft_vocab_size"] == VD
    again = load_drafter("eagle3", str(tmp_path / "exported"), target=target)
    assert again.config == d.config and again.d2t.tolist() == d.d2t.tolist()
    assert main(["export-eagle3", str(tmp_path / "published"), str(tmp_path / "x")]) == 2   # not our format
    assert "no drafter.json" in capsys.readouterr().err


def test_training_time_test_unroll_matches_the_engine_tree_steps(target):
    """Step k of the unrolled training pass at position q is what the engine computes for a depth-k
    node at q: true inputs ingested up to q-k, then k-1 deeper steps along one tree path."""
    import jax
    import jax.numpy as jnp

    from hsd_jax.cache import init_cache
    from hsd_jax.models import eagle3, llama
    from hsd_jax.train import losses

    layer = jax.jit(eagle3.layer, static_argnames="cfg")   # jitted: eager, its many small ops dispatch one by one (4x slower)
    cfg = eagle3.Eagle3Config.for_target(target.config, draft_vocab_size=VOCAB)
    params = eagle3.init_params(cfg, jax.random.key(1), std=0.1)
    rng = np.random.default_rng(2)
    w = 14
    tokens = jnp.asarray(rng.integers(1, VOCAB, (1, w)), jnp.int32)
    tcfg = target.config.replace(feature_layers=cfg.feature_layers)
    pos = jnp.arange(w, dtype=jnp.int32)[None]
    out = llama.forward(target.params, tcfg, tokens, pos, init_cache(tcfg.num_layers, 1, tcfg.num_kv_heads, 32, 8))
    batch = losses.Batch(tokens, out.features, jnp.ones((1, w), bool), jnp.ones((1, w), bool),
                         jnp.moveaxis(out.aux_features, 0, 2))
    table = target.params["embed_tokens"]["embedding"]
    outs = jax.jit(losses.unrolled_eagle3, static_argnames=("cfg", "steps"))(params, cfg, table, batch, 3)
    x_next = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], 1)
    emb = jnp.take(table, x_next, axis=0)
    fused = eagle3.fuse(params, out.aux_features)
    for k in (1, 2, 3):
        for q in (k - 1, 6, w - 2):
            s = q - k + 1                                    # the chain's last true position
            cache = init_cache(1, 1, cfg.num_kv_heads, 32, cfg.head_dim)
            h, cache = layer(params, cfg, fused[:, : s + 1], emb[:, : s + 1], pos[:, : s + 1], cache)
            cache = cache.replace(lengths=cache.lengths + s + 1)
            path, hid = [], h[:, -1:]                          # the hidden inputs along one tree path
            for j in range(1, k):                            # the depth-(j+1) node at s + j, child of the last
                path.append(hid)
                got, _ = layer(params, cfg, jnp.concatenate(path, 1), emb[:, s + 1: s + j + 1],
                                      pos[:, s + 1: s + j + 1], cache, jnp.arange(-1, j - 1, dtype=jnp.int32)[None])
                hid = got[:, -1:]
            np.testing.assert_allclose(np.asarray(hid[0, 0]), np.asarray(outs[k - 1][0, q]), rtol=1e-4, atol=1e-4,
                                       err_msg=f"step {k} at {q}")


def test_fused_readout_ablation_reads_the_token_serves_losslessly_and_has_no_published_format(target, tmp_path):
    """`readout: fused` (EAGLE-1's read-out MLP over [h; e(x)], the token-path ablation): starts as
    the plain read-out (zero output layer), then depends on the token; the engine stays lossless;
    export to the published format is refused."""
    import jax
    import jax.numpy as jnp

    from hsd_jax.config import ConfigError
    from hsd_jax.models import eagle3
    from hsd_jax.train.trainer import TrainConfig

    d = load_drafter("eagle3", target=target, random_init=True, seed=5, readout="fused", readout_scale=3.0)
    assert d.config.readout == "fused" and not np.any(np.asarray(d.params["inject"]["w2"]))
    plain_cfg = eagle3.Eagle3Config.for_target(target.config, draft_vocab_size=d.config.vd)
    h = jax.random.normal(jax.random.key(0), (4, H))
    emb = jnp.take(target.params["embed_tokens"]["embedding"], jnp.arange(4), axis=0)
    np.testing.assert_allclose(eagle3.logits(d.params, d.config, h, emb), eagle3.logits(d.params, plain_cfg, h),
                               rtol=1e-6)
    d.params["inject"]["w2"] = 0.1 * jax.random.normal(jax.random.key(1), d.params["inject"]["w2"].shape)
    moved = eagle3.logits(d.params, d.config, h, emb)
    assert not np.allclose(moved, eagle3.logits(d.params, d.config, h, emb[::-1]))   # the token matters
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, VOCAB, size=int(n)).tolist() for n in (5, 11)]
    ref = [r.token_ids for r in generate(target, prompts, max_new_tokens=16)]
    res = generate(target, prompts, max_new_tokens=16, method="eagle3", drafter=d, tree_nodes=6, tree_depth=3,
                   tree_top_k=2)
    assert [r.token_ids for r in res] == ref
    with pytest.raises(ConfigError, match="no published format"):
        eagle3.export_published(d.params, d.config, d.d2t, str(tmp_path / "out"))
    assert TrainConfig(kind="eagle3", data_dir="d", out_dir="o").readout == "plain"
    assert TrainConfig(kind="eagle", data_dir="d", out_dir="o").readout == "fused"
    with pytest.raises(ConfigError, match="readout must be"):
        TrainConfig(kind="eagle3", data_dir="d", out_dir="o", readout="mlp")
