"""Small utilities shared by tests: run a full-sequence forward and compare with PyTorch."""
import os

import numpy as np

from hsd_jax.api import FAST_COMPILE_OPTIONS
from hsd_jax.cache import init_cache
from hsd_jax.models import llama

SUITE_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE_OPTIONS.items())


def child_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a child process with `devices` fake CPU devices, keeping the suite's flags."""
    return " ".join(filter(None, [os.environ.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={devices}"]))


def jax_logits(target_or_params, cfg, tokens):
    """Logits [B, T, V] of a causal forward over tokens [B, T] from an empty cache."""
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, max(t, 8), cfg.head_dim)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits, _ = llama.forward_logits(target_or_params, cfg, tokens, pos, cache)
    return np.asarray(logits)


def torch_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def torch_greedy(model, ids, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def tiny_target(vocab=64, layers=2, heads=4, kv_heads=2, hidden=32, seed=0, max_cache_len=256, **kw):
    """A random tiny LLaMA target (no tokenizer) for fast engine tests."""
    import jax

    from hsd_jax.api import Target
    from hsd_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, attention_impl="reference", **kw)
    params = llama.init_params(cfg, jax.random.key(seed), init_std=0.3)
    return Target(params, cfg, None, max_cache_len, "tiny")


def save_hf_dir(target, path):
    """Write a target as a Hugging Face LLaMA directory (config.json + model.safetensors)."""
    import json
    import os

    from safetensors.numpy import save_file

    from hsd_jax.loading.convert import LAYER_TENSORS, expected_shapes

    cfg = target.config
    os.makedirs(path, exist_ok=True)
    p = target.params
    tensors = {"model.embed_tokens.weight": np.asarray(p["embed_tokens"]["embedding"]),
               "model.norm.weight": np.asarray(p["norm"]["scale"])}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(p["lm_head"]["kernel"]).T)
    names = expected_shapes(cfg)
    for hf, (route, transpose) in LAYER_TENSORS.items():
        if f"model.layers.0.{hf}" not in names:
            continue
        node = p["layers"]
        for r in route:
            node = node[r]
        for i in range(cfg.num_layers):
            w = np.asarray(node[i])
            tensors[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(w.T if transpose else w)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                   "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
                   "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                   "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
                   "tie_word_embeddings": cfg.tie_word_embeddings}, f)


def zero_layers(params):
    """Switch off every layer's residual contributions (attention out and MLP down projections)."""
    import jax.numpy as jnp

    lay = dict(params["layers"])
    lay["o_proj"] = {"kernel": jnp.zeros_like(lay["o_proj"]["kernel"])}
    lay["mlp"] = dict(lay["mlp"], down_proj={"kernel": jnp.zeros_like(lay["mlp"]["down_proj"]["kernel"])})
    return dict(params, layers=lay)


def bigram_target():
    """A target whose layers are switched off (feature f_p = e(x_p)) and whose head is sharp,
    so the next token is a function of the current token: an oracle can be written by hand."""
    tgt = tiny_target(vocab=64, tie_word_embeddings=False)
    params = zero_layers(tgt.params)
    tgt.params = dict(params, lm_head={"kernel": 30.0 * params["lm_head"]["kernel"]})
    return tgt


def run_cli(*args):
    """`hsd ARGS` in this process (no interpreter start, no second JAX import): a
    CompletedProcess-like object with returncode, stdout and stderr."""
    import contextlib
    import io
    import subprocess

    from hsd_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse usage errors
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def tiny_smollm2_gguf(path, hidden=96, layers=2, heads=6, kv_heads=2, seed=0):
    """A random tiny LLaMA GGUF with SmolLM2's tokenizer, chat template and vocabulary (the embedded
    file's fields): every code path that loads a GGUF by name and encodes chat text, at a fraction
    of the real model's compile and run time."""
    import gguf

    from hsd_jax.loading.gguf_file import read_gguf
    from hsd_jax.loading.gguf_loader import default_gguf_path

    src = read_gguf(default_gguf_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny random llama with the SmolLM2 tokenizer (tests)")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 8192), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, 2 * hidden), (w.add_head_count, heads),
                       (w.add_head_count_kv, kv_heads), (w.add_rope_freq_base, 100000.0),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_dimension_count, hidden // heads)):
        add(value)
    for key, value in src.fields.items():
        if key.startswith("tokenizer."):
            if isinstance(value, list):
                w.add_array(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
            elif isinstance(value, bool):
                w.add_bool(key, value)
            else:
                w.add_uint32(key, int(value))
    rng = np.random.default_rng(seed)
    dh = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * dh, hidden), f"blk.{i}.attn_k.weight": (kv_heads * dh, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * dh, hidden), f"blk.{i}.attn_output.weight": (hidden, heads * dh),
                       f"blk.{i}.ffn_gate.weight": (2 * hidden, hidden), f"blk.{i}.ffn_up.weight": (2 * hidden, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, 2 * hidden)})
    for name, shape in shapes.items():
        value = np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.3 if "token_embd" not in name else 1.0, shape)
        w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
