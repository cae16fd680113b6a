"""The drafter kind shared by the feature drafters (hsd, eagle): a `DrafterConfig`, a
draft vocabulary, weights shaped like one target layer."""
from __future__ import annotations

import numpy as np

from hsd_jax.config import ConfigError, from_json
from hsd_jax.loading.errors import ModelLoadError
from hsd_jax.methods.base import DrafterKind


def check_draft_vocab(d2t, vd: int, vocab: int, what: str = "drafter") -> None:
    """Refuse a draft-vocab map that is not `vd` ids inside the target's vocabulary."""
    if d2t is None or np.ndim(d2t) != 1 or len(d2t) != vd:
        raise ModelLoadError(f"{what} draft-vocab map must hold {vd} target ids, got shape {np.shape(d2t)}")
    if not np.issubdtype(np.asarray(d2t).dtype, np.integer):
        raise ModelLoadError(f"{what} draft-vocab map must hold integer target ids, got {np.asarray(d2t).dtype}")
    if len(d2t) and (d2t.min() < 0 or d2t.max() >= vocab):
        raise ModelLoadError(f"{what} draft-vocab map holds ids outside the target vocabulary [0, {vocab})")


def feature_drafter(kind: str) -> DrafterKind:
    from hsd_jax.models.drafter import DrafterConfig, init_drafter_params

    def config(raw: dict):
        return from_json(DrafterConfig, raw)

    def random(target, seed: int, **overrides):
        import jax

        cfg = DrafterConfig.for_target(kind, target.config, **overrides)
        return init_drafter_params(cfg, jax.random.key(seed)), cfg, np.arange(cfg.vd, dtype=np.int32)

    def finish(params, cfg, d2t, target):
        if cfg.kind != kind:
            raise ConfigError(f"a {kind} drafter needs a {kind!r} drafter config, got {cfg.kind!r}")
        cfg.check_target(target.config)
        check_draft_vocab(d2t, cfg.vd, target.config.vocab_size)
        return params, cfg, d2t

    return DrafterKind(config=config, random=random, finish=finish)
