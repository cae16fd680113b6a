"""Small utilities shared by tests: run a full-sequence forward and compare with PyTorch."""
import numpy as np

from hsd_jax.cache import init_cache
from hsd_jax.models import llama


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
