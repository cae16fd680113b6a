"""Drafter training runs: YAML config, AdamW with warmup + cosine, resumable Orbax checkpoints.

`train(cfg)` builds (or reuses) the feature cache, trains the HSD or EAGLE-style drafter with
the unrolled loss, evaluates held-out chain acceptance each `eval_every` steps, saves every
`save_every` steps (resuming from the latest checkpoint after a crash or `kill -9`), and
exports the final drafter with `save_drafter` (bf16 params) plus metrics.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hsd_jax.config import ConfigError
from hsd_jax.loading.errors import reading
from hsd_jax.models.layers import matmul_inputs
from hsd_jax.train import losses
from hsd_jax.train.data import DataError, has_target_labels, load_shards, shard_paths, shard_rows
from hsd_jax.train.features import aux_path, build_feature_cache, feature_path, label_path

# (ce_weight, feature_weight) by drafter kind when a config names neither: hsd and eagle regress the next
# target feature as EAGLE-1 does; EAGLE-3's published recipe trains on the token loss only.
LOSS_WEIGHTS = {"hsd": (0.5, 1.0), "eagle": (0.5, 1.0), "eagle3": (1.0, 0.0)}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    kind: str = "hsd"
    model: str = "smollm2-135m"
    data_dir: str | tuple = ""  # one data directory or a list of them
    data_weights: tuple = ()  # one sampling weight per data directory: its share of the training rows drawn
    #                           (empty: every training row equally likely, so a directory's share is its size)
    out_dir: str = ""
    feature_cache: str = ""
    steps: int = 1000
    batch_size: int = 8
    window: int = 256
    unroll: int = 3
    ce_positions: int = 48
    learning_rate: float = 5e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ce_weight: float | None = None  # token loss weight (default: the kind's recipe, see LOSS_WEIGHTS)
    feature_weight: float | None = None  # feature regression weight (0: token loss only; default: the kind's)
    soft_labels: bool = False  # token loss against the target's draft-vocab distribution, not the data's token
    draft_vocab_size: int = 8192
    injection: str = "fused"
    readout: str | None = None  # eagle: plain or fused (default); eagle3: plain (default, the published
    #                             format) or fused (EAGLE-1's read-out MLP over [h; e(x)]: an ablation)
    readout_context: int = 1  # path tokens the fused read-out sees (hsd: 1 = the current token only)
    drafter_layers: int = 1  # hsd / eagle: decoder layers in the drafter (the chain's recurrence)
    feature_layers: tuple = ()  # hsd / eagle3: target layers whose outputs the drafter fuses (FC) as its input
    #                             (eagle3 default: outputs of layers 1, L//2-1, L-4, as EAGLE-3 publishes)
    save_every: int = 100
    eval_every: int = 250
    max_to_keep: int = 2
    holdout_fraction: float = 0.05
    sd_layers: int = 3
    init_from: str = ""  # a drafter directory (`hsd train` output) to start from instead of random weights
    frozen: tuple = ()  # top-level drafter parameter groups kept at their starting values (e.g. eagle3
    #                     [norm, lm_head]: read out through the target's head, as hsd and eagle do)
    max_seconds: float = 0.0  # stop this run after so many seconds of training (0: no limit), then export
    feature_batch: int = 8  # sequences per target prefill when building the feature cache
    eval_untrained: bool = True  # evaluate the starting weights too (time-boxed runs skip it)
    start_step: int = 0  # with init_from and no checkpoint yet: continue the schedule from this step (a committed
    #                      campaign state on a new machine: its bf16 params, fresh optimizer moments)
    compute_dtype: str = "float32"  # matmul inputs of the train step and the feature prefill: bfloat16 runs them on
    #                                 bf16 with f32 accumulation (f32 master weights, norms and loss): ~1.7x on AVX-512 BF16
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("hsd", "eagle", "eagle3", "sd"):
            raise ConfigError(f"kind must be hsd, eagle, eagle3 or sd, got {self.kind!r}")
        if self.sd_layers < 1 or self.drafter_layers < 1:
            raise ConfigError(f"sd_layers and drafter_layers must be >= 1, got {self.sd_layers} and "
                              f"{self.drafter_layers}")
        if self.drafter_layers > 1 and self.kind not in ("hsd", "eagle"):
            raise ConfigError(f"drafter_layers is for hsd and eagle drafters, not {self.kind!r}")
        if isinstance(self.data_dir, list):
            object.__setattr__(self, "data_dir", tuple(self.data_dir))
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if isinstance(self.frozen, str) or not all(isinstance(k, str) and k for k in self.frozen):
            raise ConfigError(f"frozen must be a list of parameter group names, got {self.frozen!r}")
        object.__setattr__(self, "frozen", tuple(self.frozen))
        if self.feature_layers and self.kind not in ("hsd", "eagle3"):
            raise ConfigError(f"feature_layers is implemented for hsd and eagle3 drafters, not {self.kind!r}")
        if self.kind == "eagle3" and self.feature_layers and len(self.feature_layers) != 3:
            raise ConfigError(f"eagle3 fuses 3 target layers (low, mid, high), got {self.feature_layers}")
        if not self.data_dir or not all(isinstance(d, str) and d for d in self.data_dirs):
            raise ConfigError(f"data_dir must be a directory or a list of them, got {self.data_dir!r}")
        if isinstance(self.data_weights, (int, float, str)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.data_weights):
            raise ConfigError(f"data_weights must be a list of numbers, got {self.data_weights!r}")
        object.__setattr__(self, "data_weights", tuple(float(w) for w in self.data_weights))
        if self.data_weights and (len(self.data_weights) != len(self.data_dirs) or min(self.data_weights) < 0
                                  or sum(self.data_weights) <= 0):
            raise ConfigError(f"data_weights needs one weight >= 0 per data directory ({len(self.data_dirs)}), "
                              f"not all 0, got {list(self.data_weights)}")
        if not self.out_dir:
            raise ConfigError("out_dir is required")
        for name in ("steps", "batch_size", "window", "unroll", "ce_positions", "save_every", "eval_every",
                     "max_to_keep", "feature_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.start_step < 0 or (self.start_step and (self.start_step >= self.steps or not self.init_from)):
            raise ConfigError(f"start_step must be in [0, steps) and needs init_from, got {self.start_step}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.max_seconds < 0:
            raise ConfigError(f"max_seconds must be >= 0 (0: no limit), got {self.max_seconds}")
        for name, default in zip(("ce_weight", "feature_weight"), LOSS_WEIGHTS.get(self.kind, (1.0, 0.0))):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.ce_weight < 0 or self.feature_weight < 0 or self.ce_weight + self.feature_weight == 0:
            raise ConfigError(f"ce_weight and feature_weight must be >= 0 and not both 0, got "
                              f"{self.ce_weight} and {self.feature_weight}")
        if self.readout is None:
            object.__setattr__(self, "readout", "plain" if self.kind == "eagle3" else "fused")
        if self.readout not in ("plain", "fused"):
            raise ConfigError(f"readout must be 'plain' or 'fused', got {self.readout!r}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ConfigError("warmup_steps and weight_decay must be >= 0 and grad_clip > 0")
        if self.init_from and not os.path.isfile(os.path.join(self.init_from, "drafter.json")):
            raise ConfigError(f"init_from must be a drafter directory (with drafter.json), got {self.init_from!r}")
        if not 0 < self.holdout_fraction < 1:
            raise ConfigError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")

    @property
    def data_dirs(self) -> tuple[str, ...]:
        return (self.data_dir,) if isinstance(self.data_dir, str) else tuple(self.data_dir)

    @classmethod
    def from_yaml(cls, path: str, **overrides) -> "TrainConfig":
        import yaml

        if not os.path.isfile(path):
            raise ConfigError(f"training config not found: {path}")
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        raw.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}")
        return cls(**raw)


def cached_features(path: str, rows, ndim: int, kind=np.floating) -> np.ndarray:
    """A feature (or label: kind np.integer) cache file memory-mapped, checked against its shard's rows
    at load (an array of `kind` [rows, >= longest row, ...] of `ndim` dimensions), so a damaged cache
    is a DataError here and never a short read in the middle of training."""
    with reading(path, "damaged feature cache (delete it to rebuild)", DataError):
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    longest = max((len(t) for t, _ in rows), default=0)
    if arr.ndim != ndim or not np.issubdtype(arr.dtype, kind) or arr.shape[0] != len(rows) \
            or arr.shape[1] < longest:
        raise DataError(f"{path}: damaged feature cache (delete it to rebuild): {arr.dtype} {arr.shape} for "
                        f"{len(rows)} rows of up to {longest} tokens")
    return arr


class SequenceData:
    """Token sequences with their cached features, split into train and held-out rows.

    Each data directory is split on its own, so adding one leaves the others' held-out rows as they
    were. The held-out rows of text the target did not write (shards with target labels) are not
    evaluated (the metric follows the target's greedy path) and not trained on."""

    def __init__(self, data_dirs, cache_dir: str | None, window: int, holdout: float, seed: int,
                 feature_layers=()):
        self.window = window
        self.rows = []  # (tokens, features memmap, row in the shard, prompt_len, aux memmap, labels memmap); None: absent
        hold, train = [], []
        self.train_by_dir = train   # each directory's training rows (indices into self.rows), in data_dirs order
        for data_dir in [data_dirs] if isinstance(data_dirs, str) else data_dirs:
            first, own_labels = len(self.rows), False
            for shard in shard_paths(data_dir):
                rows = shard_rows(shard)
                feats = None if cache_dir is None else cached_features(feature_path(cache_dir, shard), rows, 3)
                aux = labels = None
                if cache_dir is not None and feature_layers:
                    aux = cached_features(aux_path(cache_dir, shard, feature_layers), rows, 4)
                if cache_dir is not None and has_target_labels(shard):
                    labels, own_labels = cached_features(label_path(cache_dir, shard), rows, 2, np.integer), True
                self.rows.extend((tokens, feats, i, plen, aux, labels) for i, (tokens, plen) in enumerate(rows))
            count = len(self.rows) - first
            if count < 2:
                raise DataError(f"{data_dir}: need at least 2 sequences, found {count}")
            order = first + np.random.default_rng(seed).permutation(count)
            n_hold = max(1, int(count * holdout))
            if not own_labels:
                hold.append(order[:n_hold])
            train.append(order[n_hold:])
        if not hold:
            raise DataError("no held-out rows: at least one data directory must hold the target's own answers "
                            "(`hsd data generate`)")
        self.holdout, self.train = np.concatenate(hold), np.concatenate(train)

    def sample_train(self, rng: np.random.Generator, n: int, weights=()) -> np.ndarray:
        """n training rows drawn by rng: uniformly over all of them, or with `weights` (one per data
        directory) first a directory by its weight, then a row of it uniformly."""
        if not weights:
            return rng.choice(self.train, size=n, replace=len(self.train) < n)
        p = np.asarray(weights, np.float64) * np.array([len(t) > 0 for t in self.train_by_dir])
        if p.sum() <= 0:
            raise DataError("data_weights give every data directory with training rows weight 0")
        dirs = rng.choice(len(p), size=n, p=p / p.sum())
        return np.array([rng.choice(self.train_by_dir[d]) for d in dirs])

    def batch(self, idx) -> losses.Batch:
        """Right-aligned windows (the last `window` tokens hold the response) of rows idx."""
        w = self.window
        d = next((self.rows[r][1].shape[-1] for r in idx if self.rows[r][1] is not None), 1)
        toks = np.zeros((len(idx), w), np.int32)
        feats = np.zeros((len(idx), w, d), np.float32)
        valid = np.zeros((len(idx), w), bool)
        chain_ok = np.zeros((len(idx), w), bool)
        first_aux = self.rows[idx[0]][4]
        aux = None if first_aux is None else np.zeros((len(idx), w) + first_aux.shape[2:], np.float32)
        labels = None
        if any(self.rows[r][5] is not None for r in idx):   # the target's next token; the data's where it wrote them
            labels = np.zeros((len(idx), w), np.int32)
        for j, r in enumerate(idx):
            tokens, fmm, i, plen, amm, lmm = self.rows[r]
            start = max(0, len(tokens) - w)
            n = len(tokens) - start
            toks[j, :n] = tokens[start:]
            if fmm is not None:
                feats[j, :n] = fmm[i, start: len(tokens)]
            if aux is not None:
                aux[j, :n] = amm[i, start: len(tokens)]
            if labels is not None:
                labels[j, :n] = tokens[start + 1:].tolist() + [0] if lmm is None else lmm[i, start: len(tokens)]
            q = np.arange(w)
            chain_ok[j] = q >= plen - 1 - start
            valid[j] = chain_ok[j] & (q + 2 < n)
        return losses.Batch(jnp.asarray(toks), jnp.asarray(feats), jnp.asarray(valid), jnp.asarray(chain_ok),
                            None if aux is None else jnp.asarray(aux), None if labels is None else jnp.asarray(labels))


def chain_report(sums: dict) -> dict:
    """Held-out metrics from `losses.chain_acceptance` sums (or `draft_lm_acceptance`'s)."""
    per = lambda key: [round(float(x), 4) for x in sums[key] / np.maximum(sums["total"], 1)]
    out = {"accept_by_depth": per("correct"),
           "chain_tau_estimate": round(1.0 + float(sums["accepted"]) / max(float(sums["chains"]), 1.0), 4),
           "heldout_chains": int(sums["chains"])}
    if "bypass_correct" in sums:
        out["bypass_accept_by_depth"] = per("bypass_correct")
        out["feature_error_vs_copy"] = [round(float(a / max(b, 1e-9)), 4)
                                        for a, b in zip(sums["feature_err"], sums["copy_err"])]
    return out


def heldout_report(evaluate, data: SequenceData, batch_size: int) -> dict:
    """`chain_report` over all held-out rows: `evaluate(batch)` returns one batch's sums. The last
    batch is padded to `batch_size` (one compiled shape) with rows masked out."""
    sums = None
    for i in range(0, len(data.holdout), batch_size):
        idx = data.holdout[i: i + batch_size]
        real = np.arange(batch_size) < len(idx)
        b = data.batch(np.resize(idx, batch_size))
        b = b._replace(valid=b.valid & real[:, None], chain_ok=b.chain_ok & real[:, None])
        got = {k: np.asarray(v, np.float64) for k, v in evaluate(b).items()}
        sums = got if sums is None else {k: sums[k] + got[k] for k in sums}
    return chain_report(sums)


def draft_vocab(seqs, prompt_lens, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent response token ids (ties by id), sorted: the draft vocabulary."""
    counts = np.zeros(vocab_size, np.int64)
    for s, p in zip(seqs, prompt_lens):
        np.add.at(counts, s[p:], 1)
    size = min(size or vocab_size, vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def vocab_coverage(data: SequenceData, d2t) -> float:
    """Share of the held-out rows' response tokens inside the draft vocabulary (the rest can never
    be drafted)."""
    inside = np.zeros(max(int(np.max(d2t)) + 1, max(int(data.rows[r][0].max()) for r in data.holdout) + 1), bool)
    inside[d2t] = True
    resp = np.concatenate([data.rows[r][0][data.rows[r][3]:] for r in data.holdout])
    return round(float(inside[resp].mean()), 4) if len(resp) else 0.0


def feature_rms(data: SequenceData, n: int = 64) -> float:
    rows = data.train[:n]
    vals = [np.asarray(data.rows[r][1][data.rows[r][2], : len(data.rows[r][0])], np.float32) for r in rows]
    return float(np.sqrt(np.mean(np.concatenate(vals) ** 2)))


def make_optimizer(cfg: TrainConfig, params: dict | None = None):
    """AdamW without its learning rate: the train step scales the update by `learning_rate(...)`,
    so a run can follow its schedule by step or, under `max_seconds`, by elapsed time. The groups
    in `cfg.frozen` (top-level keys of `params`) get no update at all, weight decay included."""
    adamw = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.scale_by_adam(),
                        optax.add_decayed_weights(cfg.weight_decay))
    if not cfg.frozen:
        return adamw
    unknown = sorted(set(cfg.frozen) - set(params or {}))
    if unknown:
        raise ConfigError(f"frozen names {unknown}, not parameter groups of this {cfg.kind} drafter "
                          f"(it has {sorted(params or {})})")
    labels = {k: jax.tree.map(lambda _, k=k: "frozen" if k in cfg.frozen else "train", v) for k, v in params.items()}
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def learning_rate(cfg: TrainConfig, step: int, elapsed: float = 0.0) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to 5% of the peak. Progress is the
    step's share of `steps` or, when `max_seconds` is set, the larger of that and the share of
    the time budget spent: a time-boxed run still ends on a low rate."""
    warm = min(1.0, (step + 1) / max(min(cfg.warmup_steps, cfg.steps - 1), 1))
    frac = step / cfg.steps
    if cfg.max_seconds:
        frac = max(frac, elapsed / cfg.max_seconds)
    cosine = 0.5 * (1.0 + np.cos(np.pi * min(frac, 1.0)))
    return float(cfg.learning_rate * warm * (0.05 + 0.95 * cosine))


def run_vocab(cfg: TrainConfig, target, data: SequenceData, init=None) -> tuple[np.ndarray, float]:
    """The run's draft vocabulary and feature scale, fixed at its first start (`<out_dir>/draft_vocab.npz`)
    so that a resumed run keeps its output head's meaning when data directories are added. A run
    started from an `init` drafter takes that drafter's."""
    from hsd_jax import distributed

    path = os.path.join(cfg.out_dir, "draft_vocab.npz")
    if distributed.agree(os.path.isfile(path)):   # process 0's view: every process takes the same branch
        with reading(path, "damaged draft vocabulary (delete it to rebuild)", DataError):
            with np.load(path, allow_pickle=False) as z:
                return z["d2t"].astype(np.int32), float(z["feature_rms"])
    if init is not None:
        d2t = np.asarray(init.d2t, np.int32)
        rms = float(getattr(init.config, "feature_rms", 0.0)) or round(feature_rms(data), 3)  # eagle3 keeps none
    else:
        rows = [data.rows[r] for r in data.train]  # training rows only: held-out coverage stays honest
        d2t = draft_vocab([r[0] for r in rows], [r[3] for r in rows], target.config.vocab_size, cfg.draft_vocab_size)
        rms = round(feature_rms(data), 3)
    if distributed.is_primary():
        os.makedirs(cfg.out_dir, exist_ok=True)
        np.savez(path + ".tmp.npz", d2t=d2t, feature_rms=np.float64(rms))
        os.replace(path + ".tmp.npz", path)
    return d2t, rms


def _feature_task(cfg: TrainConfig, target, data: SequenceData, vocab=None) -> dict:
    """HSD or EAGLE-style drafter: params, unrolled loss, held-out chain acceptance."""
    from hsd_jax.models import drafter as dmod

    init = _init_drafter(cfg, target)
    d2t, rms = vocab if vocab is not None else run_vocab(cfg, target, data, init)
    t2d = jnp.asarray(dmod.target_to_draft(d2t, target.config.vocab_size))
    dcfg = dmod.DrafterConfig.for_target(cfg.kind, target.config, draft_vocab_size=len(d2t),
                                         injection=cfg.injection, readout=cfg.readout,
                                         readout_context=cfg.readout_context, num_layers=cfg.drafter_layers,
                                         feature_layers=cfg.feature_layers, feature_rms=rms)
    dcfg.check_target(target.config)
    view = dmod.target_view(target.params, target.config, d2t)
    weights = losses.LossWeights(feature=cfg.feature_weight, ce=cfg.ce_weight, soft_labels=cfg.soft_labels)

    def loss(params, batch, key, consts):
        return losses.drafter_loss(params, dcfg, consts["view"], consts["t2d"], batch, key, steps=cfg.unroll,
                                   ce_positions=cfg.ce_positions, weights=weights)

    def accept(params, batch, consts):
        return losses.chain_acceptance(params, dcfg, consts["view"], consts["t2d"], batch, cfg.unroll)

    if init is None:
        params = dmod.init_drafter_params(dcfg, jax.random.key(cfg.seed))
    elif init.config != dcfg or not np.array_equal(init.d2t, d2t):
        diff = sorted(f.name for f in dataclasses.fields(dcfg) if getattr(init.config, f.name) != getattr(dcfg, f.name))
        raise ConfigError(f"init_from {cfg.init_from!r} does not match this run's drafter "
                          f"(differs in {diff or ['draft vocabulary']})")
    else:
        params = _float32(init.params)
    return dict(params=params, loss=loss, accept=accept, consts={"view": view, "t2d": t2d}, config=dcfg, d2t=d2t)


def _eagle3_task(cfg: TrainConfig, target, data: SequenceData, vocab=None) -> dict:
    """EAGLE-3 drafter: fused low/mid/high features, training-time-test unroll, token loss (plus, when
    `feature_weight` > 0, EAGLE-1's regression of the next target feature), reduced vocabulary from
    the same data as the other drafters."""
    from hsd_jax.models import eagle3
    from hsd_jax.models.drafter import target_to_draft

    init = _init_drafter(cfg, target)
    d2t, rms = vocab if vocab is not None else run_vocab(cfg, target, data, init)
    t2d = target_to_draft(d2t, target.config.vocab_size)
    dcfg = eagle3.Eagle3Config.for_target(target.config, draft_vocab_size=len(d2t), feature_layers=cfg.feature_layers,
                                          readout=cfg.readout, readout_scale=rms if cfg.readout == "fused" else 1.0)
    dcfg.check_target(target.config)

    def loss(params, batch, key, consts):
        return losses.eagle3_loss(params, dcfg, consts["table"], consts["t2d"], batch, key, steps=cfg.unroll,
                                  ce_positions=cfg.ce_positions,
                                  weights=losses.LossWeights(feature=cfg.feature_weight, ce=cfg.ce_weight),
                                  feature_rms=rms)

    def accept(params, batch, consts):
        return losses.eagle3_acceptance(params, dcfg, consts["table"], consts["d2t"], batch, cfg.unroll)

    if init is None:   # the head starts as the target's (final norm, LM head columns of the draft vocabulary)
        params = eagle3.init_params(dcfg, jax.random.key(cfg.seed), std=0.02)
        from hsd_jax.models.llama import lm_head_weight

        params["lm_head"]["kernel"] = jnp.take(lm_head_weight(target.params, target.config), jnp.asarray(d2t), axis=1)
        params["norm"]["scale"] = jnp.asarray(target.params["norm"]["scale"], jnp.float32)
    elif init.config != dcfg or not np.array_equal(init.d2t, d2t):
        raise ConfigError(f"init_from {cfg.init_from!r} does not match this run's eagle3 drafter")
    else:
        params = _float32(init.params)
    consts = {"table": target.params["embed_tokens"]["embedding"], "t2d": jnp.asarray(t2d), "d2t": jnp.asarray(d2t)}
    return dict(params=params, loss=loss, accept=accept, consts=consts, config=dcfg, d2t=d2t)


def _float32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _init_drafter(cfg: TrainConfig, target):
    """The drafter named by `init_from` (checked against the run's kind and target), or None."""
    if not cfg.init_from:
        return None
    from hsd_jax.api import load_drafter

    return load_drafter(cfg.kind, cfg.init_from, target=target)


def sd_draft_config(target_cfg, layers: int):
    return target_cfg.replace(num_layers=layers, feature_layers=(), attention_impl="reference")


def _sd_task(cfg: TrainConfig, target) -> dict:
    """Standard-SD draft LM: `sd_layers` of the target's layers (evenly spaced) as the start,
    the target's embeddings and head shared and frozen (not stored with the drafter)."""
    dcfg = sd_draft_config(target.config, cfg.sd_layers)
    picks = np.linspace(0, target.config.num_layers - 1, cfg.sd_layers).round().astype(int)
    tp = target.params
    params = {"layers": jax.tree.map(lambda a: jnp.asarray(a)[picks], tp["layers"]), "norm": tp["norm"]}
    init = _init_drafter(cfg, target)
    if init is not None:
        if init.config != dcfg:
            raise ConfigError(f"init_from {cfg.init_from!r} does not match this run's draft model (sd_layers {cfg.sd_layers})")
        params = _float32({k: init.params[k] for k in params})
    frozen = {k: tp[k] for k in ("embed_tokens", "lm_head") if k in tp}

    def loss(params, batch, key, consts):
        return losses.draft_lm_loss(params, consts, dcfg, batch, key, ce_positions=cfg.ce_positions)

    def accept(params, batch, consts):
        return losses.draft_lm_acceptance(params, consts, dcfg, batch, cfg.unroll)

    return dict(params=params, loss=loss, accept=accept, consts=frozen, config=dcfg, d2t=None)


def train_task(cfg: TrainConfig, target, data: SequenceData | None, vocab=None) -> dict:
    """The run's task for its kind: params, loss(params, batch, key, consts), accept, consts, config,
    d2t. `vocab` = (d2t, feature_rms) skips `run_vocab` (no data needed: `hsd compile`)."""
    if cfg.kind == "sd":
        return _sd_task(cfg, target)
    if cfg.kind == "eagle3":
        return _eagle3_task(cfg, target, data, vocab)
    return _feature_task(cfg, target, data, vocab)


def with_matmul_inputs(loss_fn, dtype: str):
    """loss_fn traced under `matmul_inputs(dtype)` (f32: as it is)."""
    if dtype == "float32":
        return loss_fn

    def mixed(*args):
        with matmul_inputs(dtype):
            return loss_fn(*args)
    return mixed


def make_train_step(loss_fn, tx, example_state=None, compiler_options=None):
    """The jitted optimizer step (state, batch, key[, lr][, consts]) -> (state, metrics). With `lr`
    the transformation's update is a direction, scaled by -lr (see `make_optimizer`); without it
    the update is applied as it is. `consts` (the frozen target pieces a loss reads) is passed on
    as `loss_fn(params, batch, key, consts)`: an argument, never a closure, so the target's
    weights are not baked into the program as constants (slow compiles, a copy per program).
    Given a sharded `example_state`, the new state keeps its shardings and metrics come back
    replicated. `compiler_options`: XLA's, as `api.compile_options` chooses them for the target."""
    def step(state, batch, key, lr=None, consts=None):
        extra = () if consts is None else (consts,)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch, key, *extra)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        if lr is not None:
            updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, dict(metrics, loss=loss)

    leaves = jax.tree.leaves(example_state)
    opts = compiler_options or None
    if not leaves or not isinstance(leaves[0].sharding, jax.sharding.NamedSharding):
        return jax.jit(step, compiler_options=opts)
    replicated = jax.sharding.NamedSharding(leaves[0].sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(step, out_shardings=(jax.tree.map(lambda x: x.sharding, example_state), replicated),
                   compiler_options=opts)


def train(cfg: TrainConfig, *, target=None, mesh=None, progress: bool = True, log=print,
          until_step: int | None = None) -> dict:
    """Run (or resume) a training run; returns the final held-out metrics.

    until_step: stop at this step (checkpoint, evaluation and exported drafter as at the end) without
    changing the schedule, which still runs to `cfg.steps`: a long run in chunks. Every evaluation
    is appended to `<out_dir>/history.jsonl`, so the curve spans the chunks.

    mesh (`hsd_jax.sharding.make_mesh`): the frozen target, the drafter and its optimizer state
    are sharded by the partition rules and batches over `data` (batch_size must divide by it).
    Only process 0 logs and writes the JSON files; checkpoint saves are collective.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from hsd_jax import distributed, sharding
    from hsd_jax.api import compile_options, load_target, save_drafter
    from hsd_jax.models import drafter as dmod

    primary = distributed.is_primary()
    log = log if primary else (lambda *_: None)
    progress = progress and primary

    for data_dir in cfg.data_dirs:
        if not os.path.isdir(data_dir) or not shard_paths(data_dir):
            raise DataError(f"no training data in {data_dir!r}: run `hsd data generate --out {data_dir}`")
    target = target or load_target(cfg.model, max_cache_len=512, tokenizer=False)
    if cfg.kind == "eagle3" and not cfg.feature_layers:   # the layers EAGLE-3 publishes for this depth
        from hsd_jax.models.eagle3 import Eagle3Config

        cfg = dataclasses.replace(cfg, feature_layers=Eagle3Config.default_layers(target.config.num_layers))
    cache_dir = None
    if cfg.kind != "sd":
        cache_dir = cfg.feature_cache or os.path.join(cfg.out_dir, "features")
        for data_dir in cfg.data_dirs:
            build_feature_cache(target, data_dir, cache_dir, batch_size=cfg.feature_batch, progress=progress,
                                feature_layers=cfg.feature_layers, matmul_dtype=cfg.compute_dtype)
    data = SequenceData(cfg.data_dirs, cache_dir, cfg.window, cfg.holdout_fraction, cfg.seed, cfg.feature_layers)
    place = lambda tree: tree
    if mesh is not None:
        sharding.check_mesh(target.config, mesh, cfg.batch_size, "target")
        target = dataclasses.replace(target, params=sharding.shard_params(target.params, mesh))
        place = lambda tree: jax.tree.map(lambda x: sharding.shard_batch(x, mesh), tree)
    task = train_task(cfg, target, data)
    params = task["params"]
    tx = make_optimizer(cfg, params)
    state = {"params": params, "opt": tx.init(params)}
    if mesh is not None:
        state = sharding.shard_params(state, mesh)
    copts = compile_options(target.params)
    train_step = make_train_step(with_matmul_inputs(task["loss"], cfg.compute_dtype), tx,
                                 state if mesh is not None else None, copts)

    eval_fn = jax.jit(task["accept"], compiler_options=copts or None)
    consts = task["consts"]

    def evaluate(params):
        return heldout_report(lambda b: eval_fn(params, place(b), consts), data, cfg.batch_size)

    ckpt_dir = os.path.abspath(os.path.join(cfg.out_dir, "checkpoints"))
    mngr = None   # process 0 alone reads and writes checkpoints, as host arrays (a drafter's state is small)
    if primary:
        os.makedirs(ckpt_dir, exist_ok=True)
        mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep, save_interval_steps=cfg.save_every, create=False,
            multiprocessing_options=distributed.primary_options()))
    start = distributed.agree(mngr.latest_step() if primary else None) or 0
    if start:
        host = sharding.fetch(state)
        if primary:
            host = mngr.restore(start, args=ocp.args.StandardRestore(host))
        host = distributed.broadcast_arrays(host)
        state = sharding.shard_params(host, mesh) if mesh is not None else jax.device_put(host)
        log(f"resumed from step {start}")
    elif cfg.start_step:
        start = cfg.start_step
        log(f"continuing the schedule at step {start} from {cfg.init_from}")
    stop = min(cfg.steps, until_step or cfg.steps)
    if stop <= start:
        raise ConfigError(f"this run is at step {start}; nothing to do until step {stop}")
    if primary:
        with open(os.path.join(cfg.out_dir, "train_config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
    history, losses_seen, t0 = [], [], time.time()

    def record(step, report):
        history.append(dict(step=step, **report))
        if primary:
            with open(os.path.join(cfg.out_dir, "history.jsonl"), "a") as f:
                f.write(json.dumps(history[-1]) + "\n")

    if start == 0 and cfg.eval_untrained:
        record(0, evaluate(state["params"]))
        log(f"untrained: {history[-1]}")

    def host_batch(step):
        return data.batch(data.sample_train(np.random.default_rng([cfg.seed, step]), cfg.batch_size,
                                            cfg.data_weights))

    bar = tqdm(total=stop, initial=start, desc=f"train {cfg.kind}", disable=not progress)
    train_t0 = rate_t0 = time.time()
    last = start
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the next batch is gathered while this step runs
        pending = pool.submit(host_batch, start)
        for step in range(start, stop):
            batch = pending.result()
            if step + 1 < stop:
                pending = pool.submit(host_batch, step + 1)
            lr = np.float32(distributed.agree(learning_rate(cfg, step, time.time() - train_t0)))
            state, metrics = train_step(state, place(batch), jax.random.fold_in(jax.random.key(cfg.seed), step), lr,
                                        consts)
            loss_now = float(metrics["loss"])
            losses_seen.append(loss_now)
            last = step + 1
            if step == start:  # throughput is measured from the end of the first (compiling) step
                rate_t0 = time.time()
            out_of_time = bool(cfg.max_seconds) and distributed.agree(time.time() - train_t0 > cfg.max_seconds)
            if last % cfg.save_every == 0 or last == stop or out_of_time:
                host = sharding.fetch(state)
                if primary:
                    mngr.save(last, args=ocp.args.StandardSave(host), force=last == stop or out_of_time)
            if (step + 1) % 10 == 0:
                bar.set_postfix(loss=f"{loss_now:.3f}", acc1=f"{float(metrics['acc_1']):.3f}")
            if (step + 1) % cfg.eval_every == 0 and step + 1 < stop and not out_of_time:
                record(step + 1, evaluate(state["params"]))
                log(f"step {step + 1}: {history[-1]}")
            bar.update(1)
            if out_of_time:
                log(f"max_seconds {cfg.max_seconds} reached at step {last} of {cfg.steps}")
                break
    bar.close()
    if primary:
        mngr.wait_until_finished()
        mngr.close()
    k = max(1, min(10, len(losses_seen) // 2))
    steps_per_s = (last - start - 1) / max(time.time() - rate_t0, 1e-9) if last - start > 1 else 0.0
    tokens_per_s = steps_per_s * cfg.batch_size * cfg.window
    record(last, evaluate(state["params"]))
    final = dict(step=last, steps_per_s=round(steps_per_s, 3), window_tokens_per_s=round(tokens_per_s, 1),
                 **{k: v for k, v in history[-1].items() if k != "step"}, wall_seconds_this_run=round(time.time() - t0, 1),
                 loss_first=round(float(np.mean(losses_seen[:k])), 4) if losses_seen else None,
                 loss_last=round(float(np.mean(losses_seen[-k:])), 4) if losses_seen else None)
    if task["d2t"] is not None:
        final["vocab_coverage_heldout"] = vocab_coverage(data, task["d2t"])
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state["params"])
    save_drafter(dmod.Drafter(cfg.kind, half, task["config"], task["d2t"]), os.path.join(cfg.out_dir, "drafter"))
    if primary:
        seqs, plens = load_shards(cfg.data_dirs)
        with open(os.path.join(cfg.out_dir, "history.jsonl")) as f:   # every chunk's evaluations, the last = final's
            curve = [json.loads(line) for line in f if line.strip()]
        with open(os.path.join(cfg.out_dir, "metrics.json"), "w") as f:
            json.dump({"final": final, "history": curve[:-1], "train_tokens": int(sum(len(s) for s in seqs)),
                       "response_tokens": int(sum(len(s) - p for s, p in zip(seqs, plens)))}, f, indent=1)
    log(f"final: {final}")
    return final
