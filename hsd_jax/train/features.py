"""Target features for training, computed once by prefill and cached as float16 `.npy` files.

Measured on the 2-core CPU: generating a token costs ~10x a prefill token, and a training
run reads every feature many times, so caching (1.15 KB per token for d=576) beats
recomputing in each step. One file per data shard, `<data dir name>/feat_XXXXX.npy`
[n, L_shard, d], with rows aligned to the shard's `tokens`. A drafter that fuses several
target layers (`feature_layers`) also gets `<data dir name>/aux-<layers>/aux_XXXXX.npy`
[n, L_shard, k, d]: those layers' outputs. Shards written with the target's own labels (`hsd data
text`: prefill over text the target did not write) also get `lab_XXXXX.npy` [n, L_shard] int32: the
target's greedy next token after each position. `precision.json` in each data dir's folder records
the matmul inputs of its prefill (float32, or bfloat16: ~2x faster on AVX-512 BF16, features within
bf16 rounding); a cache is never extended at another precision.
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.api import PROMPT_BUCKET, round_up

FEATURE_SPAN = 4 * PROMPT_BUCKET   # a feature prefill's width is a multiple of this (64 tokens)
from hsd_jax.cache import init_cache
from hsd_jax.config import ConfigError
from hsd_jax.models import llama
from hsd_jax.models.layers import matmul_inputs
from hsd_jax.train.data import DataError, has_target_labels, read_shard, shard_paths


@functools.partial(jax.jit, static_argnames=("cfg", "matmul_dtype", "with_labels"))
def _features(params, cfg, tokens, matmul_dtype=None, with_labels=False):
    """Pre-norm last-layer features and `feature_layers` outputs (f16), and (with_labels) the target's
    greedy next token at every position, from the f32 head."""
    b, t = tokens.shape
    with matmul_inputs(matmul_dtype):
        cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, t, cfg.head_dim, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out = llama.forward(params, cfg, tokens, pos, cache)
    labels = jnp.zeros((b, 0), jnp.int32)
    if with_labels:
        labels = jnp.argmax(llama.logits_from_features(params, cfg, out.features), -1).astype(jnp.int32)
    return (out.features.astype(jnp.float16), jnp.moveaxis(out.aux_features, 0, 2).astype(jnp.float16), labels)


def feature_path(cache_dir: str, shard: str) -> str:
    """`<cache_dir>/<data dir name>/feat_XXXXX.npy`: one cache folder serves several data dirs."""
    name = os.path.basename(shard).replace("shard_", "feat_").replace(".npz", ".npy")
    return os.path.join(cache_dir, os.path.basename(os.path.dirname(os.path.abspath(shard))), name)


def label_path(cache_dir: str, shard: str) -> str:
    """`<cache_dir>/<data dir name>/lab_XXXXX.npy`: the target's own next-token labels."""
    return feature_path(cache_dir, shard).replace("feat_", "lab_")


def _check_precision(folder: str, matmul_dtype: str) -> None:
    """Record the prefill's matmul precision in a new cache folder; refuse to extend a cache built at
    another one (folders written before the record existed hold f32 prefills)."""
    path = os.path.join(folder, "precision.json")
    have = None
    if os.path.isfile(path):
        try:
            with open(path) as f:
                have = json.load(f)["matmul_inputs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: unreadable feature-cache precision record ({e})") from None
    elif os.path.isdir(folder) and any(n.startswith("feat_") for n in os.listdir(folder)):
        have = "float32"
    if have is not None and have != matmul_dtype:
        raise ConfigError(f"the feature cache {folder} was built with {have} matmul inputs, not {matmul_dtype}: "
                          f"use another feature_cache (or that compute_dtype)")
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"matmul_inputs": matmul_dtype}, f)
        os.replace(path + ".tmp", path)


def aux_path(cache_dir: str, shard: str, layers) -> str:
    """`<cache_dir>/<data dir name>/aux-<layers>/aux_XXXXX.npy`: the outputs of target `layers`."""
    name = os.path.basename(shard).replace("shard_", "aux_").replace(".npz", ".npy")
    folder = "aux-" + "-".join(str(int(i)) for i in layers)
    return os.path.join(os.path.dirname(feature_path(cache_dir, shard)), folder, name)


def _save(path: str, arr: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.save(path + ".tmp.npy", arr)
    os.replace(path + ".tmp.npy", path)


def cache_files(cache_dir: str, shard: str, layers=()) -> list[str]:
    """The cache files a shard needs: features, the fused layers' outputs, the target's own labels."""
    return [feature_path(cache_dir, shard)] + ([aux_path(cache_dir, shard, layers)] if layers else []) + (
        [label_path(cache_dir, shard)] if has_target_labels(shard) else [])


def cache_complete(data_dir: str, cache_dir: str, feature_layers=()) -> bool:
    return all(os.path.exists(p) for shard in shard_paths(data_dir) for p in cache_files(cache_dir, shard, feature_layers))


def build_feature_cache(target, data_dir: str, cache_dir: str, batch_size: int = 8, progress: bool = True,
                        feature_layers=(), matmul_dtype: str = "float32") -> None:
    """Prefill every shard's sequences through the target; skips shards already cached. With
    `feature_layers`, those layers' outputs are cached too; shards that ask for the target's own labels
    get them. matmul_dtype: the prefill's matmul inputs (float32 or bfloat16). Multi-process: every
    process runs the prefill (the target may be sharded over all of them), process 0 alone writes,
    and all return once the cache is complete."""
    from tqdm import tqdm

    from hsd_jax import distributed
    from hsd_jax.sharding import fetch

    layers = tuple(int(i) for i in feature_layers)
    cfg = target.config.replace(feature_layers=layers)
    shards = shard_paths(data_dir)
    if shards and distributed.is_primary():
        _check_precision(os.path.dirname(feature_path(cache_dir, shards[0])), matmul_dtype)
    low = None if matmul_dtype == "float32" else jnp.dtype(matmul_dtype)
    for shard in tqdm(shards, desc="target features", unit="shard", disable=not progress):
        out = feature_path(cache_dir, shard)
        aux_out = aux_path(cache_dir, shard, layers) if layers else None
        lab_out = label_path(cache_dir, shard) if has_target_labels(shard) else None
        if distributed.agree(all(os.path.exists(p) for p in cache_files(cache_dir, shard, layers))):
            continue
        tokens, lengths, _ = read_shard(shard)
        n, length = tokens.shape
        feats = np.zeros((n, length, cfg.hidden_size), np.float16)
        aux = np.zeros((n, length, len(layers), cfg.hidden_size), np.float16)
        labels = np.zeros((n, length if lab_out else 0), np.int32)
        # rows of similar length prefill together, each batch padded to its own longest row (in steps of
        # FEATURE_SPAN, few shapes to compile), not the shard's: GSM8K's reference answers average half their
        # shard's width. Positions past a row's length are never read; they stay 0.
        order = np.argsort(lengths, kind="stable")
        for i in range(0, n, batch_size):
            rows = order[i: i + batch_size]
            span = min(length, int(lengths[rows].max()))
            padded = np.zeros((len(rows), round_up(max(span, 1), FEATURE_SPAN)), np.int32)
            padded[:, :span] = tokens[rows, :span]
            f, a, lab = fetch(_features(target.params, cfg, padded, low, lab_out is not None))
            feats[rows, :span] = f[:, :span]
            aux[rows, :span] = a[:, :span]
            if lab_out:
                labels[rows, :span] = lab[:, :span]
        if distributed.is_primary():
            if not os.path.exists(out):
                _save(out, feats)
            if aux_out is not None:
                _save(aux_out, aux)
            if lab_out is not None:
                _save(lab_out, labels)
    distributed.barrier("feature_cache")
