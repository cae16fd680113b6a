"""Qwen3 dense targets: tiny random checkpoints written by transformers (tied and untied heads, head_dim
48 with hidden 128 and 4 heads, per-head q/k RMSNorm) against transformers' PyTorch Qwen3, every
method against ar on them, their published-format EAGLE-3 drafters, and the loader's refusals."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hsd_jax import generate, load_drafter, load_target
from hsd_jax.loading.errors import ModelLoadError
from hsd_jax.loading.hf import hf_config
from tests.helpers import jax_logits, run_cli, torch_greedy, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, KV, DH, LAYERS = 128, 4, 2, 48, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGIT_TOL_F32 = 1e-3   # test_model_parity's f32 tolerance
# Qwen3's chat template without the thinking block: the assistant turn opens with an empty <think>
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")


def write_qwen3(path, tied: bool, seed: int = 0, shard: bool = False, vocab: int | None = None, **dims):
    """A random Qwen3ForCausalLM saved by transformers. Without `vocab`: SmolLM2's byte-level BPE
    vocabulary in the directory as Qwen3 publishes it (tokenizer.json, the chat template and EOS in
    tokenizer_config.json, the end-of-turn ids in generation_config.json); with one, no tokenizer (a
    small vocabulary for engine tests on token ids). `dims` overrides Qwen3Config sizes. Returns the
    PyTorch model."""
    from hsd_jax.loading.gguf_loader import default_gguf_path
    from hsd_jax.loading.tokenizer import gguf_tokenizer

    tok = None if vocab else gguf_tokenizer(default_gguf_path())
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**dict(dict(
        vocab_size=vocab or len(tok), hidden_size=HIDDEN, intermediate_size=192, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=DH, max_position_embeddings=2048,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=0,
        eos_token_id=None if vocab else tok.convert_tokens_to_ids("<|endoftext|>")), **dims))
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():   # norms (q_norm, k_norm included) away from 1
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p))
    if tok is not None:
        model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.save_pretrained(path, safe_serialization=True, **({"max_shard_size": "2MB"} if shard else {}))
    if tok is None:
        return model
    tok.save_pretrained(path)
    os.remove(os.path.join(path, "chat_template.jinja"))
    tc = json.load(open(os.path.join(path, "tokenizer_config.json")))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(dict(tc, chat_template=CHAT_TEMPLATE), f)
    return model


@pytest.fixture(scope="module", params=["untied", "tied"])
def qwen3(request, tmp_path_factory):
    """(directory, PyTorch model, our Target) of a tiny Qwen3 written by transformers."""
    path = str(tmp_path_factory.mktemp(f"qwen3_{request.param}"))
    model = write_qwen3(path, tied=request.param == "tied", shard=request.param == "untied")
    return path, model, load_target(path, max_cache_len=512)


@pytest.fixture(scope="module")
def prompts(qwen3, mt_prompts):
    tgt = qwen3[2]
    return [tgt.encode(mt_prompts[i], chat=True) for i in (0, 33)]


def test_config_params_chat_template_and_eos_come_from_the_directory(qwen3):
    path, _, tgt = qwen3
    cfg = tgt.config
    assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == DH != cfg.hidden_size // cfg.num_heads
    assert tgt.params["layers"]["q_norm"]["scale"].shape == (LAYERS, DH)
    assert ("lm_head" in tgt.params) == (not cfg.tie_word_embeddings)
    sharded = os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert sharded == (not cfg.tie_word_embeddings)   # the untied one was saved in shards
    tok = tgt.tokenizer
    # config.json's <|endoftext|>, then generation_config.json's <|im_end|> (the tokenizer's eos too)
    assert cfg.eos_token_ids == tuple(tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    text = tok.decode(tgt.encode("Hi there", chat=True))
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_logits_and_greedy_tokens_match_pytorch_on_real_prompts(qwen3, prompts):
    _, model, tgt = qwen3
    ours = jax_logits(tgt.params, tgt.config, [prompts[0]])
    ref = torch_logits(model, [prompts[0]])
    assert ours.shape == ref.shape and np.abs(ours - ref).max() < LOGIT_TOL_F32
    res = generate(tgt, prompts, max_new_tokens=20)   # the engine's serving path (CPU kernels at f32)
    for ids, r in zip(prompts, res):
        assert r.token_ids == torch_greedy(model, ids, 20)
    from hsd_jax import cpu_kernels

    if cpu_kernels.enabled():   # the loop ran the layers' matmuls (q/k at 4 x 48, 2 x 48 wide) in the kernels
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "mlp/down_proj"} <= set(tgt._packed[1])
        assert cpu_kernels.attention_supported(np.float32, tgt.config.head_dim)


SMALL_VOCAB = 96


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(directory, PyTorch model, Target) of an untied tiny Qwen3 with a 96-token vocabulary (engine tests)."""
    path = str(tmp_path_factory.mktemp("qwen3_small"))
    model = write_qwen3(path, tied=False, seed=1, vocab=SMALL_VOCAB)
    return path, model, load_target(path, tokenizer=False, max_cache_len=256)


TREE = dict(tree_nodes=6, tree_depth=3, tree_top_k=2)
# eagle3 runs with published-format drafters (random weights) in test_published_eagle3_drafter_...
METHODS = [("sd", dict(gamma=3)), ("ngram", dict(gamma=3)), ("lookup", TREE), ("hsd", TREE), ("eagle", TREE)]


@pytest.mark.parametrize("method, shape", METHODS)
def test_every_method_with_a_random_drafter_equals_ar(small, method, shape):
    tgt = small[2]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, SMALL_VOCAB, size=n).tolist() for n in (3, 11, 19)]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=24)]
    dr = load_drafter(method, target=tgt, random_init=True, seed=1)
    res = generate(tgt, prompts, max_new_tokens=24, method=method, drafter=dr, **shape)
    assert [r.token_ids for r in res] == ref


def test_qwen3_shards_over_the_model_axis_with_replicated_head_norms(small):
    """Partition rules on a 1x2 abstract mesh: q/k/v column-sharded by heads, q/k norms ([L, Dh],
    shared by every head) replicated."""
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    from hsd_jax.sharding import param_specs

    mesh = AbstractMesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    specs = param_specs(small[2].params, mesh)["layers"]
    assert specs["q_proj"]["kernel"] == P(None, None, "model")
    assert specs["q_norm"]["scale"] == P() and specs["k_norm"]["scale"] == P()


def test_loads_and_encodes_without_torch(qwen3):
    """`import torch` fails in the child (so transformers sees no torch, as on a serving host): the
    Qwen3 directory, its tokenizer, template and EOS ids load and encode to the same ids. The engine
    itself never imports torch (test_tokenizer runs generate so)."""
    path, _, tgt = qwen3
    if tgt.config.tie_word_embeddings:
        pytest.skip("one directory is enough")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        import hsd_jax
        target = hsd_jax.load_target({path!r}, max_cache_len=128)
        print(target.config.eos_token_ids, target.encode("What is 2 + 2?", chat=True))
        assert sys.modules["torch"] is None
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == f"{tgt.config.eos_token_ids} {tgt.encode('What is 2 + 2?', chat=True)}"


BASE = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen3_moe", "num_experts": 8}, "model_type 'qwen3_moe' is a mixture-of-experts model"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window: true"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types has 'sliding_attention'"),
])
def test_moe_and_sliding_window_configs_are_refused_naming_the_field(change, message):
    with pytest.raises(ModelLoadError, match=message):
        hf_config(dict(BASE, **change), "cfg")
    cfg = hf_config(dict(BASE, layer_types=["full_attention"] * 2, use_sliding_window=False), "cfg")
    assert cfg.qk_norm and cfg.head_dim == 16


def test_cli_refuses_a_qwen3_moe_directory_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="qwen3_moe")))
    r = run_cli("generate", "--model", str(tmp_path), "--prompt", "hi")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "mixture-of-experts" in lines[0]


# A drafter laid out as those SpecForge publishes for Qwen3 targets: head_dim in config.json and not
# hidden / heads, Qwen3's rope_theta and eps, a reduced draft vocabulary with d2t.
EAGLE3_DIMS = dict(h=HIDDEN, heads=HEADS, kv=KV, dh=DH, inter=96, vocab=SMALL_VOCAB, vd=64)
QWEN3_ROPE = {"rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960}


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama_layer", "qwen3_layer"])
def test_published_eagle3_drafter_matches_a_pytorch_reference_and_ar(small, tmp_path, qk_norm):
    from tests.test_eagle3 import ours, torch_reference, write_eagle3

    path, _, tgt = small
    ids, tensors = write_eagle3(str(tmp_path / "e3"), dims=EAGLE3_DIMS, extra_config=QWEN3_ROPE, qk_norm=qk_norm)
    d = load_drafter("eagle3", str(tmp_path / "e3"), target=tgt)
    assert d.config.head_dim == DH and d.config.qk_norm == qk_norm and d.d2t.tolist() == ids.tolist()
    tokens, root, y = [5, 17, 3, 42, 8, 8, 21, 60, 1, 90], 33, 12
    capture = tuple(i + 1 for i in d.config.feature_layers)
    ref_prompt, ref_step = torch_reference(path, tensors, tokens, root, y, capture, dims=EAGLE3_DIMS,
                                           theta=1e6, eps=1e-6)
    got_prompt, got_step = ours(tgt, d, tokens, root, y)
    np.testing.assert_allclose(got_prompt, ref_prompt, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(got_step, ref_step, rtol=2e-4, atol=2e-4)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, SMALL_VOCAB, size=n).tolist() for n in (4, 13)]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=20)]
    res = generate(tgt, prompts, max_new_tokens=20, method="eagle3", drafter=d, **TREE)
    assert [r.token_ids for r in res] == ref


def test_published_eagle3_drafter_runs_from_the_cli_and_one_for_another_target_is_refused(qwen3, tmp_path, mt_prompts):
    """`hsd generate --method eagle3 --drafter DIR` on the tiny Qwen3 gives transformers' greedy tokens
    (= ar's: test_logits_and_greedy_...); a drafter published for a wider target (SmolLM2's 576) is
    one `error:` line."""
    from tests.test_eagle3 import SMOLLM2, write_eagle3

    path, model, tgt = qwen3
    if tgt.config.tie_word_embeddings:
        pytest.skip("one directory is enough")
    dims = dict(EAGLE3_DIMS, vocab=tgt.config.vocab_size, vd=256)
    write_eagle3(str(tmp_path / "e3"), dims=dims, seed=3, extra_config=QWEN3_ROPE)
    base = ["generate", "--model", path, "--prompt", mt_prompts[3], "--chat", "--max-new-tokens", "12",
            "--max-cache-len", "256", "--json"]
    r = run_cli(*base, "--method", "eagle3", "--drafter", str(tmp_path / "e3"))
    assert r.returncode == 0, r.stderr
    e3 = json.loads(r.stdout.strip().splitlines()[-1])
    assert e3["method"] == "eagle3" and e3["drafter_forwards"] > 0
    assert e3["token_ids"] == torch_greedy(model, tgt.encode(mt_prompts[3], chat=True), 12)
    write_eagle3(str(tmp_path / "other"), dims=SMOLLM2, seed=4)
    r = run_cli(*base, "--method", "eagle3", "--drafter", str(tmp_path / "other"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:")
    assert "expects target features of width 576" in lines[0]


@pytest.mark.parametrize("switch", ["fc_norm", "norm_output", "norm_before_residual"])
def test_eagle3_variants_with_another_layer_are_refused(small, tmp_path, switch):
    from tests.test_eagle3 import write_eagle3

    write_eagle3(str(tmp_path / "e3"), dims=EAGLE3_DIMS, extra_config={switch: True})
    with pytest.raises(ModelLoadError, match=f"{switch}: true is an EAGLE-3 variant"):
        load_drafter("eagle3", str(tmp_path / "e3"), target=small[2])


@pytest.fixture(scope="module")
def small_data(small, tmp_path_factory):
    from hsd_jax.train.data import generate_data

    rng = np.random.default_rng(0)
    data = str(tmp_path_factory.mktemp("qwen3_data"))
    generate_data(small[2], [rng.integers(0, SMALL_VOCAB, size=8).tolist() for _ in range(16)], data, batch_size=16,
                  max_new_tokens=24, temperature=0.0, progress=False)
    return data


@pytest.mark.parametrize("kind", ["hsd", "eagle", "eagle3"])
def test_hsd_train_runs_on_a_qwen3_target(small, small_data, tmp_path, kind):
    """`hsd train` a few steps on the tiny Qwen3 (its features, Dh 48 and q/k norms in the target
    pass); the eagle and eagle3 drafters it writes serve ar's tokens (hsd's random ones do in
    test_every_method_...)."""
    path, _, tgt = small
    data = small_data
    out = tmp_path / "run"
    config = {"kind": kind, "model": path, "data_dir": data, "out_dir": str(out), "steps": 4, "batch_size": 4,
              "window": 24, "unroll": 2, "ce_positions": 8, "learning_rate": 1e-3, "warmup_steps": 1,
              "save_every": 4, "eval_every": 1000, "holdout_fraction": 0.25,
              "draft_vocab_size": 64 if kind == "eagle3" else 0}
    (tmp_path / "train.yaml").write_text(json.dumps(config))
    r = run_cli("train", "--config", str(tmp_path / "train.yaml"))
    assert r.returncode == 0, r.stderr[-2000:]
    dr = load_drafter(kind, str(out / "drafter"), target=tgt)
    if kind == "hsd":
        return
    prompt = [[5, 9, 33, 2, 17, 40]]
    res = generate(tgt, prompt, max_new_tokens=16, method=kind, drafter=dr, **TREE)
    assert res[0].token_ids == generate(tgt, prompt, max_new_tokens=16)[0].token_ids


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    """A transformers-written untied Qwen3 with an 8-token vocabulary (exact sampling marginals by
    enumeration) and smaller still (3000 rows per sampling check): hidden 32, 2 heads of head_dim 24
    (not 32 / 2), 1 KV head, q/k norms, 2 layers."""
    path = str(tmp_path_factory.mktemp("qwen3_vocab8"))
    write_qwen3(path, tied=False, seed=4, vocab=8, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                head_dim=24, intermediate_size=64, num_hidden_layers=2)
    return load_target(path, tokenizer=False, max_cache_len=64)


@pytest.mark.parametrize("method", ["sd", "eagle", "eagle3", "hsd", "ngram", "lookup"])
def test_every_method_samples_the_target_distribution_at_t1(vocab8, method):
    """test_speculative's T=1 check (chi-square of 3 sampled positions against the exact marginals)
    on a Qwen3 checkpoint, for every speculative method with a random drafter."""
    from tests.test_speculative import check_sampling_distribution

    check_sampling_distribution(vocab8, method, {})
