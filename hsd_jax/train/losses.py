"""Unrolled ("training-time test") losses for the HSD and EAGLE-style feature drafters.

Step k = 1..K predicts f_{q+1} at every position q with the chain's real context: true
features up to q-k+1 and the drafter's own step-s predictions for the k-1 positions after
it, exactly as the chain runs at inference. A one-layer drafter's K/V at a position depend
only on that position's input, so every step is one parallel pass whose attention picks,
for query q and key r <= q, the K/V of source step s = max(0, k-1-(q-r)).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from hsd_jax.models import drafter as dmod
from hsd_jax.models.layers import rms_norm
from hsd_jax.models.llama import DecoderLayer


class Batch(NamedTuple):
    tokens: jax.Array     # [B, W] int32 window of the sequence
    features: jax.Array   # [B, W, d] true target features (pre-norm, last layer)
    valid: jax.Array      # [B, W] bool: position q has a response label x_{q+2} and f_{q+1}
    chain_ok: jax.Array   # [B, W] bool: a chain may start at q (q >= prompt end - 1)
    aux: jax.Array | None = None  # [B, W, k, d] outputs of the drafter's `feature_layers` (when it fuses them)
    labels: jax.Array | None = None  # [B, W] int32 token after position q as the target predicts it (None:
    #                                  the data's own next token, as in self-distilled data)


def train_labels(batch: Batch) -> jax.Array:
    """[B, W]: the token a chain step from position q drafts, x_{q+2}: the data's, or the target's own
    prediction there (`Batch.labels`) for text the target did not write. The last positions pad."""
    if batch.labels is None:
        return jnp.concatenate([batch.tokens[:, 2:], batch.tokens[:, -2:]], 1)
    return jnp.concatenate([batch.labels[:, 1:], batch.labels[:, -1:]], 1)


def multi_source_attention(q, ks, vs, step: int):
    """q [B, W, Hq, Dh] (as `DecoderLayer.project` makes it; the output too); ks, vs: per source step
    s < step, [B, W, Hkv, Dh]. Causal."""
    b, w, hq, dh = q.shape
    q = q.transpose(0, 2, 1, 3)
    hkv = ks[0].shape[2]
    qg = q.reshape(b, hkv, hq // hkv, w, dh).astype(jnp.float32) / jnp.sqrt(jnp.float32(dh))
    qi = jnp.arange(w)[:, None]
    ri = jnp.arange(w)[None, :]
    source = jnp.maximum(0, step - 1 - (qi - ri))
    scores = jnp.zeros((b, hkv, hq // hkv, w, w), jnp.float32)
    for s, k in enumerate(ks):
        sc = jnp.einsum("bhgqd,brhd->bhgqr", qg, k.astype(jnp.float32))
        scores = jnp.where(source == s, sc, scores)
    scores = jnp.where(ri <= qi, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, -1)
    out = jnp.zeros((b, hkv, hq // hkv, w, dh), jnp.float32)
    for s, v in enumerate(vs):
        out = out + jnp.einsum("bhgqr,brhd->bhgqd", jnp.where(source == s, probs, 0.0), v.astype(jnp.float32))
    return out.reshape(b, hq, w, dh).transpose(0, 2, 1, 3)


def _shift_right(x, first):
    return jnp.concatenate([first[:, :1], x[:, :-1]], 1)


def unrolled_features(params, dcfg, view, batch: Batch, steps: int) -> list[jax.Array]:
    """Drafter predictions G^(k) [B, W, d] for k = 1..steps (G^(k)_q predicts f_{q+1}). Each of the
    drafter's layers keeps its keys and values per source step, as the engine's cache holds them."""
    layer = DecoderLayer(dcfg.layer_config())
    lps = [{"params": jax.tree.map(lambda a, i=i: a[i], params["layers"])} for i in range(dcfg.num_layers)]
    b, w = batch.tokens.shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    x_next = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
    if dcfg.kind == "hsd":
        aux = None if not dcfg.feature_layers else jnp.moveaxis(batch.aux, 2, 0).astype(jnp.float32)
        z = dmod.input_features(params, dcfg, batch.features.astype(jnp.float32), aux)
    else:
        z = dmod.eagle_inputs(params, dcfg, view, batch.features, x_next)
    z0, outs = z, []
    ks, vs = [[] for _ in lps], [[] for _ in lps]
    for k in range(1, steps + 1):
        g = z
        for lp, lk, lv in zip(lps, ks, vs):
            q, kk, vv = layer.apply(lp, g, pos, method=DecoderLayer.project)
            lk.append(kk), lv.append(vv)
            g = layer.apply(lp, g, multi_source_attention(q, lk, lv, k), method=DecoderLayer.output)
        outs.append(g)
        prev = _shift_right(g, z0)
        z = prev if dcfg.kind == "hsd" else dmod.eagle_inputs(params, dcfg, view, prev, x_next)
    return outs


class LossWeights(NamedTuple):
    feature: float = 1.0
    ce: float = 0.5
    step_decay: float = 0.8
    soft_labels: bool = False  # cross-entropy against the target's distribution over the draft vocab


def target_draft_probs(view, f, eps: float) -> jax.Array:
    """The target's next-token distribution restricted to the draft vocabulary (renormalised),
    from its pre-norm last-layer features f [..., d]: the dense soft label."""
    h = rms_norm(f.astype(jnp.float32), view.norm_scale, eps)
    return jax.nn.softmax(jnp.einsum("...d,dv->...v", h, view.head.astype(jnp.float32)), -1)


def path_context(tokens: jax.Array, n: int) -> jax.Array | None:
    """[B, W, n]: for position q the tokens x_q, x_{q-1}, ... (the path before x_{q+1}, most recent
    first; clamped at the window start), or None when n == 0."""
    if n == 0:
        return None
    return jnp.stack([jnp.concatenate([tokens[:, :1].repeat(i, 1), tokens[:, : tokens.shape[1] - i]], 1)
                      for i in range(n)], -1)


def _step_mask(batch: Batch, k: int):
    """Valid (position, step k) pairs: the chain starting at q-k+1 lies in the response."""
    start_ok = jnp.roll(batch.chain_ok, k - 1, axis=1) & (jnp.arange(batch.valid.shape[1]) >= k - 1)
    return batch.valid & start_ok


def _ce_picks(batch: Batch, key, ce_positions: int):
    """`ce_positions` response positions per row drawn with replacement ([B, n]), and whether a row has any."""
    b, w = batch.valid.shape
    logits_p = jnp.where(batch.valid, 0.0, -jnp.inf)
    pick = jax.random.categorical(key, jnp.broadcast_to(logits_p[:, None], (b, ce_positions, w)), axis=-1)
    return pick, jnp.any(batch.valid, 1, keepdims=True)


def _next_features(batch: Batch) -> jax.Array:
    """f_{q+1} at every position q (the last repeats): what step outputs regress onto."""
    return jnp.concatenate([batch.features[:, 1:], batch.features[:, -1:]], 1).astype(jnp.float32)


def _feature_loss(g, f_next, mask, feature_rms: float):
    """Smooth-L1 distance of step outputs g from the next features, scaled by the feature RMS,
    averaged over the masked positions."""
    m = mask.astype(jnp.float32)
    feat = optax.huber_loss((g - f_next) / feature_rms, delta=1.0).mean(-1)
    return (feat * m).sum() / jnp.maximum(m.sum(), 1.0)


def drafter_loss(params, dcfg, view, t2d, batch: Batch, key, *, steps: int, ce_positions: int,
                 weights: LossWeights = LossWeights()):
    """Smooth-L1 feature regression on all positions plus draft-vocab cross-entropy on
    `ce_positions` sampled response positions per row, summed over unroll steps. The
    cross-entropy's label is the data's next token, or with `weights.soft_labels` the target's
    whole distribution over the draft vocabulary (KL up to a constant)."""
    outs = unrolled_features(params, dcfg, view, batch, steps)
    f_next = _next_features(batch)
    x_next = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
    labels = train_labels(batch)
    ctx = path_context(batch.tokens, dcfg.readout_context - 1)
    pick, has_any = _ce_picks(batch, key, ce_positions)
    soft = None
    if weights.soft_labels:
        soft = jax.lax.stop_gradient(target_draft_probs(view, jnp.take_along_axis(f_next, pick[..., None], 1),
                                                        dcfg.rms_norm_eps))
    total, metrics = 0.0, {}
    for k, g in enumerate(outs, 1):
        m = _step_mask(batch, k).astype(jnp.float32)
        feat = _feature_loss(g, f_next, m, dcfg.feature_rms)
        g_sel = jnp.take_along_axis(g, pick[..., None], 1)
        lab = t2d[jnp.take_along_axis(labels, pick, 1)]
        ctx_sel = None if ctx is None else jnp.take_along_axis(ctx, pick[..., None], 1)
        logits = dmod.readout(params, dcfg, view, g_sel, jnp.take_along_axis(x_next, pick, 1), ctx_sel)
        ce_mask = (jnp.take_along_axis(m, pick, 1) > 0) & has_any
        if soft is None:
            ce_mask = ce_mask & (lab >= 0)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(lab, 0))
        else:
            ce = optax.softmax_cross_entropy(logits, soft)
        ce = (ce * ce_mask).sum() / jnp.maximum(ce_mask.sum(), 1)
        acc = ((jnp.argmax(logits, -1) == lab) * ce_mask).sum() / jnp.maximum(ce_mask.sum(), 1)
        total = total + weights.step_decay ** (k - 1) * (weights.feature * feat + weights.ce * ce)
        metrics.update({f"feat_{k}": feat, f"ce_{k}": ce, f"acc_{k}": acc})
    return total, metrics


def chain_acceptance(params, dcfg, view, t2d, batch: Batch, steps: int):
    """Held-out chain diagnostics along the target's greedy path, by chain depth k = 1..steps
    (HSD.md, "A chain that works"). Returns a dict of sums (the caller divides over batches):

    correct, total [steps]: top-1 acceptance of the depth-k draft;
    bypass_correct [steps]: the same read-out applied to the last true feature f_{q-k+1} in place
        of the chain state: what the read-out alone can do (a working chain loses many points);
    feature_err, copy_err [steps]: RMS distance of the chain state from the true next feature,
        and of the copy baseline (the last true feature) from it (ratio < 1: the chain beats copying);
    accepted, chains: accepted length of depth-`steps` chains (tau estimate = 1 + accepted / chains).
    """
    outs = unrolled_features(params, dcfg, view, batch, steps)
    feats = batch.features.astype(jnp.float32)
    f_next = _next_features(batch)
    x_next = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
    labels = jnp.concatenate([batch.tokens[:, 2:], batch.tokens[:, -2:]], 1)
    correct, masks, sums = [], [], {k: [] for k in ("bypass_correct", "feature_err", "copy_err")}
    ctx = path_context(batch.tokens, dcfg.readout_context - 1)
    top1 = lambda g: jnp.take(view.d2t, jnp.argmax(dmod.readout(params, dcfg, view, g, x_next, ctx), -1))
    rms = lambda a: jnp.sqrt(jnp.mean(jnp.square(a), -1))
    for k, g in enumerate(outs, 1):
        mask = _step_mask(batch, k)
        last_true = jnp.roll(feats, k - 1, axis=1)  # f_{q-k+1}: the chain's anchor for depth k at q
        correct.append(top1(g) == labels)
        masks.append(mask)
        sums["bypass_correct"].append(((top1(last_true) == labels) & mask).sum())
        sums["feature_err"].append((rms(g - f_next) * mask).sum())
        sums["copy_err"].append((rms(last_true - f_next) * mask).sum())
    return dict(_acceptance_sums(batch, correct, masks), **{k: jnp.stack(v) for k, v in sums.items()})


def _acceptance_sums(batch: Batch, correct: list, masks: list) -> dict:
    """Per-depth top-1 hits and totals, and the accepted length of every full-depth chain
    (a chain starting at s reads depth k at position s + k - 1)."""
    steps, w = len(correct), batch.tokens.shape[1]
    start_ok = batch.chain_ok & batch.valid & (jnp.arange(w) + steps - 1 < w)
    run = jnp.ones_like(start_ok)
    acc_len = jnp.zeros(start_ok.shape, jnp.int32)
    for k in range(steps):
        run = run & jnp.roll(correct[k] & masks[k], -k, axis=1)
        acc_len = acc_len + run
    return {"correct": jnp.stack([(c & mk).sum() for c, mk in zip(correct, masks)]),
            "total": jnp.stack([mk.sum() for mk in masks]),
            "accepted": (acc_len * start_ok).sum(), "chains": start_ok.sum()}


def _eagle3_next_embeddings(table, batch: Batch) -> jax.Array:
    """e(x_{q+1}) [B, W, H]: the token every unroll step at q reads (and a fused read-out with it)."""
    x_next = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
    return jnp.take(table, x_next, axis=0).astype(jnp.float32)


def unrolled_eagle3(params, cfg, table, batch: Batch, steps: int) -> list[jax.Array]:
    """EAGLE-3's training-time test: outputs H^(k) [B, W, H] for k = 1..steps. Step 1 reads the fused
    target features fc([low; mid; high]) at q, step k the drafter's own step-(k-1) output at q-1,
    always with the token x_{q+1}; attention sees each earlier position at its own source step."""
    from hsd_jax.models import eagle3

    b, w = batch.tokens.shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    emb = _eagle3_next_embeddings(table, batch)
    hidden = h0 = eagle3.fuse(params, jnp.moveaxis(batch.aux, 2, 0).astype(jnp.float32))
    ks, vs, outs = [], [], []
    for k in range(1, steps + 1):
        q, kk, vv = eagle3.project(params, cfg, hidden, emb, pos)
        ks.append(kk), vs.append(vv)
        outs.append(eagle3.finish(params, cfg, hidden, multi_source_attention(q, ks, vs, k)))
        hidden = _shift_right(outs[-1], h0)
    return outs


def eagle3_loss(params, cfg, table, t2d, batch: Batch, key, *, steps: int, ce_positions: int,
                weights: LossWeights = LossWeights(feature=0.0, ce=1.0), feature_rms: float = 1.0):
    """EAGLE-3's token loss: draft-vocab cross-entropy of the data's next token at every unroll step
    on `ce_positions` sampled response positions per row. With `weights.feature` > 0 it adds EAGLE-1's
    smooth-L1 regression of each step's output h onto the target's next last-layer feature (pre-norm,
    divided by `feature_rms`, as hsd's and eagle's), which the published recipe drops."""
    from hsd_jax.models import eagle3

    outs = unrolled_eagle3(params, cfg, table, batch, steps)
    labels = train_labels(batch)
    pick, has_any = _ce_picks(batch, key, ce_positions)
    emb_at_pick = jnp.take_along_axis(_eagle3_next_embeddings(table, batch), pick[..., None], 1)
    lab = t2d[jnp.take_along_axis(labels, pick, 1)]
    total, metrics = 0.0, {}
    f_next = _next_features(batch) if weights.feature else None
    for k, h in enumerate(outs, 1):
        m = _step_mask(batch, k)
        logits = eagle3.logits(params, cfg, jnp.take_along_axis(h, pick[..., None], 1), emb_at_pick)
        mask = jnp.take_along_axis(m, pick, 1) & has_any & (lab >= 0)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(lab, 0))
        ce = (ce * mask).sum() / jnp.maximum(mask.sum(), 1)
        acc = ((jnp.argmax(logits, -1) == lab) * mask).sum() / jnp.maximum(mask.sum(), 1)
        step_loss = weights.ce * ce
        metrics.update({f"ce_{k}": ce, f"acc_{k}": acc})
        if weights.feature:
            feat = _feature_loss(h, f_next, m, feature_rms)
            step_loss = step_loss + weights.feature * feat
            metrics[f"feat_{k}"] = feat
        total = total + weights.step_decay ** (k - 1) * step_loss
    return total, metrics


def eagle3_acceptance(params, cfg, table, d2t, batch: Batch, steps: int) -> dict:
    """Held-out top-1 acceptance by depth along the target's greedy path, and chain lengths
    (`chain_acceptance`'s first sums; EAGLE-3's state is not a target feature, so no feature rows)."""
    from hsd_jax.models import eagle3

    outs = unrolled_eagle3(params, cfg, table, batch, steps)
    labels = jnp.concatenate([batch.tokens[:, 2:], batch.tokens[:, -2:]], 1)
    emb = _eagle3_next_embeddings(table, batch)
    correct = [jnp.take(d2t, jnp.argmax(eagle3.logits(params, cfg, h, emb), -1)) == labels for h in outs]
    return _acceptance_sums(batch, correct, [_step_mask(batch, k) for k in range(1, steps + 1)])


def _draft_lm_logits(params, cfg, tokens):
    """Causal forward of a draft LM over windows [B, W]; features [B, W, d]."""
    from hsd_jax.cache import init_cache
    from hsd_jax.models import llama

    b, w = tokens.shape
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, w, cfg.head_dim)
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    return llama.forward(params, cfg, tokens, pos, cache).features


def draft_lm_loss(params, frozen, cfg, batch: Batch, key, *, ce_positions: int):
    """SD draft LM distillation: cross-entropy against the target's greedy next token (the
    self-distilled data at T=0) on sampled response positions. `frozen` = shared embeddings."""
    from hsd_jax.models import llama

    full = dict(params, **frozen)
    feats = _draft_lm_logits(full, cfg, batch.tokens)
    b, w = batch.tokens.shape
    labels = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
    pick = jax.random.categorical(key, jnp.broadcast_to(jnp.where(batch.valid, 0.0, -jnp.inf)[:, None],
                                                        (b, ce_positions, w)), axis=-1)
    logits = llama.logits_from_features(full, cfg, jnp.take_along_axis(feats, pick[..., None], 1))
    lab = jnp.take_along_axis(labels, pick, 1)
    m = jnp.take_along_axis(batch.valid, pick, 1) & jnp.any(batch.valid, 1, keepdims=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, lab)
    ce = (ce * m).sum() / jnp.maximum(m.sum(), 1)
    acc = ((jnp.argmax(logits, -1) == lab) * m).sum() / jnp.maximum(m.sum(), 1)
    return ce, {"ce_1": ce, "acc_1": acc}


def draft_lm_acceptance(params, frozen, cfg, batch: Batch, steps: int):
    """As `chain_acceptance` for a draft LM (acceptance sums only: it has no feature chain):
    along the target's greedy path the draft at depth k is the LM's next-token prediction at the
    chain's (k-1)-th accepted position."""
    from hsd_jax.models import llama

    full = dict(params, **frozen)
    logits = llama.logits_from_features(full, cfg, _draft_lm_logits(full, cfg, batch.tokens))
    labels = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
    w = batch.tokens.shape[1]
    ok = (jnp.argmax(logits, -1) == labels) & jnp.roll(batch.valid, 1, axis=1)
    start_ok = batch.chain_ok & batch.valid & (jnp.arange(w) + steps < w)
    run = jnp.ones_like(start_ok)
    acc_len = jnp.zeros(start_ok.shape, jnp.int32)
    n_corr, n_tot = [], []
    for k in range(steps):
        hit = jnp.roll(ok, -(k + 1), axis=1)
        run = run & hit
        acc_len = acc_len + run
        n_corr.append((hit & start_ok).sum())
        n_tot.append(start_ok.sum())
    return {"correct": jnp.stack(n_corr), "total": jnp.stack(n_tot), "accepted": (acc_len * start_ok).sum(),
            "chains": start_ok.sum()}
