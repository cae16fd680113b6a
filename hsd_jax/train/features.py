"""Target features for training, computed once by prefill and cached as float16 `.npy` files.

Measured on the 2-core CPU: generating a token costs ~10x a prefill token, and a training
run reads every feature many times, so caching (1.15 KB per token for d=576) beats
recomputing in each step. One file per data shard, `<data dir name>/feat_XXXXX.npy`
[n, L_shard, d], with rows aligned to the shard's `tokens`.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.api import PROMPT_BUCKET, round_up
from hsd_jax.cache import init_cache
from hsd_jax.models import llama
from hsd_jax.train.data import shard_paths


@functools.partial(jax.jit, static_argnames=("cfg",))
def _features(params, cfg, tokens):
    b, t = tokens.shape
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, t, cfg.head_dim, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = llama.forward(params, cfg, tokens, pos, cache)
    return out.features.astype(jnp.float16), out.aux_features.astype(jnp.float16)


def feature_path(cache_dir: str, shard: str) -> str:
    """`<cache_dir>/<data dir name>/feat_XXXXX.npy`: one cache folder serves several data dirs."""
    name = os.path.basename(shard).replace("shard_", "feat_").replace(".npz", ".npy")
    return os.path.join(cache_dir, os.path.basename(os.path.dirname(os.path.abspath(shard))), name)


def build_feature_cache(target, data_dir: str, cache_dir: str, batch_size: int = 8, progress: bool = True) -> None:
    """Prefill every shard's sequences through the target; skips shards already cached."""
    from tqdm import tqdm

    cfg = target.config.replace(feature_layers=())
    for shard in tqdm(shard_paths(data_dir), desc="target features", unit="shard", disable=not progress):
        out = feature_path(cache_dir, shard)
        if os.path.exists(out):
            continue
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with np.load(shard, allow_pickle=False) as z:
            tokens = z["tokens"]
        width = round_up(tokens.shape[1], PROMPT_BUCKET)
        padded = np.zeros((tokens.shape[0], width), np.int32)
        padded[:, : tokens.shape[1]] = tokens
        feats = np.zeros((tokens.shape[0], tokens.shape[1], cfg.hidden_size), np.float16)
        for i in range(0, len(padded), batch_size):
            f, _ = _features(target.params, cfg, padded[i: i + batch_size])
            feats[i: i + batch_size] = np.asarray(f)[:, : tokens.shape[1]]
        np.save(out + ".tmp.npy", feats)
        os.replace(out + ".tmp.npy", out)
