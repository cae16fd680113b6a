"""EAGLE-3: fused low/mid/high target features, one layer over [token; hidden], its own LM head over
a reduced vocabulary (`hsd_jax.models.eagle3`). The tree search, ingestion and prompt pass are
EAGLE-2's (`methods.eagle`); only the drafter's step and read-out differ. Loads published EAGLE-3
checkpoints (config.json + model.safetensors) as they are, or drafters saved by `save_drafter`.
"""
from __future__ import annotations

import jax
import numpy as np

from hsd_jax.config import ConfigError, from_json
from hsd_jax.methods.base import DrafterKind, Method
from hsd_jax.methods.eagle import Ops, round_functions
from hsd_jax.methods.features import check_draft_vocab
from hsd_jax.models import eagle3 as model
from hsd_jax.models.layers import take


def ops(dp, dc, view) -> Ops:
    table = model.embedding(dp, view.embedding)

    def step(hidden, tokens, pos, cache, parents):
        return model.layer(dp, dc, hidden, take(table, tokens), pos, cache, parents)

    return Ops(step, lambda h, tokens: model.logits(dp, dc, h, take(table, tokens)),
               lambda out: model.fuse(dp, out.aux_features),
               dc.cache_shape)


init, draft, update = round_functions(ops)


def _config(raw: dict):
    return from_json(model.Eagle3Config, raw)


def _random(target, seed: int, **overrides):
    cfg = model.Eagle3Config.for_target(target.config, **overrides)
    return model.init_params(cfg, jax.random.key(seed)), cfg, np.arange(cfg.vd, dtype=np.int32)


def _finish(params, cfg, d2t, target):
    if not isinstance(cfg, model.Eagle3Config):
        raise ConfigError(f"an eagle3 drafter needs an EAGLE-3 config, got {type(cfg).__name__}")
    cfg.check_target(target.config)
    check_draft_vocab(d2t, cfg.vd, target.config.vocab_size, "eagle3 drafter")
    return params, cfg, np.asarray(d2t, np.int32)


def _read(path: str, target):
    """A published EAGLE-3 directory (config.json + model.safetensors), or None for our own format."""
    return model.load_published(path, target.config) if model.is_published_dir(path) else None


METHOD = Method("eagle3", "EAGLE-3: fused low/mid/high target features, own reduced-vocab head, dynamic tree",
                init, draft, update, DrafterKind(config=_config, random=_random, finish=_finish, read=_read),
                scratch=lambda spec: (spec.tree_depth - 1) * spec.tree_top_k)
