"""EAGLE-3 drafter: fused low/mid/high target features, one decoder layer over [token; hidden], its
own norm and reduced-vocabulary LM head; in the published checkpoint format (EAGLE reference,
SpecForge, sglang and vLLM loaders).

At position q the layer reads the target's features of q fused by `fc` (or, deeper in the draft
tree, its own previous output h) and the embedding of token x_{q+1}:

    x = [input_layernorm(e(x_{q+1})); hidden_norm(g)]          (2H wide, into q/k/v)
    h = g + o_proj(attention(x));  h = h + mlp(post_attention_layernorm(h))
    logits(x_{q+2}) = lm_head(norm(h))  over the draft vocabulary; target id = draft id + d2t[draft id]

The fused features are the inputs of target layers 2, L//2 and L-3 (outputs of layers 1, L//2-1,
L-4); a config's `eagle_config.eagle_aux_hidden_state_layer_ids` names layer outputs directly.

Drafters for Qwen3 targets in this format (e.g. SpecForge's qwen3 configs) are this same LLaMA layer,
with a head_dim that need not be hidden / heads (read from config.json; the cache and RoPE use it). Some SpecForge
forks write a Qwen3-style layer (`Qwen3ForCausalLMEagle3`): the same keys plus per-head q/k RMSNorms
(`midlayer.self_attn.q_norm` / `k_norm`), applied before RoPE when the checkpoint has them.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax import cpu_kernels
from hsd_jax.cache import KVCache, write_layer
from hsd_jax.config import ConfigError, ModelConfig, RopeScaling, _require, from_json, json_repr
from hsd_jax.loading.errors import ModelLoadError, reading
from hsd_jax.models.drafter import packed_matmul
from hsd_jax.models.layers import apply_rope, init_program, rms_norm, rope_inv_freq

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLMEagle3")
# config.json switches of EAGLE-3 variants whose layer differs from the one implemented here
UNSUPPORTED_SWITCHES = ("fc_norm", "norm_output", "norm_before_residual")
LAYER_KEYS = ("hidden_norm", "input_layernorm", "post_attention_layernorm")
QK_NORMS = ("q_norm", "k_norm")
INDEX_TENSORS = ("d2t", "t2d")   # integer / boolean vocabulary maps beside the float weights


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 drafter and the target it serves. Hashable: a static jit argument."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                      # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]      # target layer outputs fused by fc: low, mid, high
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-5
    own_embedding: bool = False          # the checkpoint carries embed_tokens (else the target's)
    qk_norm: bool = False                # per-head RMSNorm on q and k before RoPE (Qwen3-style layer)
    readout: str = "plain"               # "fused": EAGLE-1's read-out MLP over [h; e(x_{q+1})] before the head
    #                                      (an ablation of the token path, outside the published format)
    readout_scale: float = 1.0           # scale of the fused read-out's term (the target features' RMS)

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size", "target_hidden_size"):
            _require(getattr(self, name) > 0, f"eagle3 {name} must be positive, got {getattr(self, name)}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"eagle3 num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        _require(self.draft_vocab_size <= self.vocab_size,
                 f"eagle3 draft_vocab_size {self.draft_vocab_size} exceeds the vocabulary {self.vocab_size}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        _require(len(self.feature_layers) == 3, f"eagle3 fuses 3 target layers, got {self.feature_layers}")
        _require(self.readout in ("plain", "fused"), f"eagle3 readout must be 'plain' or 'fused', got {self.readout!r}")
        _require(self.readout_scale > 0, f"eagle3 readout_scale must be > 0, got {self.readout_scale}")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def vd(self) -> int:
        return self.draft_vocab_size

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of its KV cache."""
        return 1, self.num_kv_heads, self.head_dim

    def check_target(self, target_cfg: ModelConfig) -> None:
        """Refuse a drafter that does not fit the target, naming the mismatch."""
        _require(self.target_hidden_size == target_cfg.hidden_size,
                 f"eagle3 drafter expects target features of width {self.target_hidden_size}, the target's are "
                 f"{target_cfg.hidden_size}")
        _require(self.vocab_size == target_cfg.vocab_size,
                 f"eagle3 drafter vocab {self.vocab_size} does not match the target's {target_cfg.vocab_size}")
        _require(self.own_embedding or self.hidden_size == target_cfg.hidden_size,
                 f"eagle3 drafter width {self.hidden_size} differs from the target's {target_cfg.hidden_size} and the "
                 "checkpoint has no embed_tokens of its own")
        for i in self.feature_layers:
            _require(0 <= i < target_cfg.num_layers,
                     f"eagle3 feature layer {i} does not exist in a target with {target_cfg.num_layers} layers")

    @staticmethod
    def default_layers(num_layers: int) -> tuple[int, int, int]:
        """Outputs of target layers 1, L//2-1, L-4: the inputs of layers 2, L//2, L-3 (clipped to the
        layers a very shallow test target has)."""
        return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, **kw) -> "Eagle3Config":
        base = dict(hidden_size=target_cfg.hidden_size, num_heads=target_cfg.num_heads,
                    num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
                    intermediate_size=target_cfg.intermediate_size, vocab_size=target_cfg.vocab_size,
                    draft_vocab_size=target_cfg.vocab_size, target_hidden_size=target_cfg.hidden_size,
                    feature_layers=cls.default_layers(target_cfg.num_layers), rope_theta=target_cfg.rope_theta,
                    rope_scaling=target_cfg.rope_scaling, rms_norm_eps=target_cfg.rms_norm_eps)
        base.update(kw)
        return cls(**base)


@init_program("cfg", "std")
def init_params(cfg: Eagle3Config, key: jax.Array, std: float = 0.05) -> dict:
    """Random weights in the layout `load_published` produces ([in, out] kernels)."""
    h, hq, hkv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"fc": (3 * cfg.target_hidden_size, h), "q_proj": (2 * h, hq), "k_proj": (2 * h, hkv),
              "v_proj": (2 * h, hkv), "o_proj": (hq, h), "gate_proj": (h, cfg.intermediate_size),
              "up_proj": (h, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, h), "lm_head": (h, cfg.vd)}
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    w = {name: {"kernel": std * jax.random.normal(keys[name], shape)} for name, shape in shapes.items()}
    ones = lambda: {"scale": jnp.ones((h,))}
    mid = {k: ones() for k in LAYER_KEYS}
    mid.update({k: w[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj")})
    if cfg.qk_norm:
        mid.update({k: {"scale": jnp.ones((cfg.head_dim,))} for k in QK_NORMS})
    mid["mlp"] = {k: w[k] for k in ("gate_proj", "up_proj", "down_proj")}
    params = {"fc": w["fc"], "midlayer": mid, "norm": ones(), "lm_head": w["lm_head"]}
    if cfg.readout == "fused":   # zero output layer: starts as the plain read-out
        from hsd_jax.models.drafter import fused_readout_params

        params["inject"] = fused_readout_params(jax.random.fold_in(key, 1), 2 * h, 2 * h, h)
    return params


# The weights `api.serving_drafter_params` packs for `cpu_kernels.stacked_matmul` (as [1, f / 32, d, 32]),
# by their names in `packed_kernels`
PACKED = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def kernels_of(params: dict) -> dict:
    """{name: [in, out] kernel} of the PACKED weights."""
    mid = params["midlayer"]
    return {"fc": params["fc"]["kernel"], "lm_head": params["lm_head"]["kernel"],
            **{k: mid[k]["kernel"] for k in ("q_proj", "k_proj", "v_proj", "o_proj")},
            **{k: mid["mlp"][k]["kernel"] for k in ("gate_proj", "up_proj", "down_proj")}}


def _dense(params: dict, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w, through the CPU kernel from the packed copy when the params are served with one (drafts only:
    bf16 weights move acceptance, never an output), else XLA's dot; in w's dtype either way."""
    return packed_matmul(x, w, params.get("packed_kernels", {}).get(name))


def fuse(params: dict, aux: jax.Array) -> jax.Array:
    """g = fc([low; mid; high]) from the target's layer outputs aux [3, ..., H_target]."""
    w = params["fc"]["kernel"]
    return _dense(params, "fc", jnp.concatenate(list(aux), -1).astype(w.dtype), w)


def project(params: dict, cfg: Eagle3Config, hidden: jax.Array, emb: jax.Array, positions: jax.Array):
    """Rotated q [B, T, Hq, Dh] and k, v [B, T, Hkv, Dh] of x = [input_layernorm(emb); hidden_norm(hidden)]."""
    p = params["midlayer"]
    dt = p["q_proj"]["kernel"].dtype
    b, t, _ = hidden.shape
    x = jnp.concatenate([rms_norm(emb, p["input_layernorm"]["scale"], cfg.rms_norm_eps),
                         rms_norm(hidden, p["hidden_norm"]["scale"], cfg.rms_norm_eps)], -1).astype(dt)
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    heads = lambda name, n: _dense(params, name, x, p[name]["kernel"]).reshape(b, t, n, cfg.head_dim)
    q, k = heads("q_proj", cfg.num_heads), heads("k_proj", cfg.num_kv_heads)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"]["scale"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"]["scale"], cfg.rms_norm_eps)
    return apply_rope(q, positions, inv), apply_rope(k, positions, inv), heads("v_proj", cfg.num_kv_heads)


def finish(params: dict, cfg: Eagle3Config, hidden: jax.Array, attn: jax.Array) -> jax.Array:
    """h = hidden + o_proj(attn [B, T, Hq, Dh]), then the residual MLP: the layer's output [B, T, H]."""
    p = params["midlayer"]
    dt = p["q_proj"]["kernel"].dtype
    b, t, _ = hidden.shape
    dense = lambda name, x, w: _dense(params, name, x, w["kernel"])
    h = hidden.astype(dt) + dense("o_proj", attn.reshape(b, t, -1).astype(dt), p["o_proj"])
    m = p["mlp"]
    y = rms_norm(h, p["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
    return h + dense("down_proj", jax.nn.silu(dense("gate_proj", y, m["gate_proj"])) * dense("up_proj", y, m["up_proj"]),
                     m["down_proj"])


def layer(params: dict, cfg: Eagle3Config, hidden: jax.Array, emb: jax.Array, positions: jax.Array,
          cache: KVCache, parents: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """The decoder layer over hidden [B, T, H] (fused features or its own earlier outputs) and token
    embeddings emb [B, T, H]; writes its K/V at slots lengths + i. Returns (h [B, T, H], cache)."""
    from hsd_jax.models.llama import xla_attention
    from pallas_kernels.tree_attention import ancestor_mask

    q, k, v = project(params, cfg, hidden, emb, positions)
    ck = write_layer(cache.k, 0, k, cache.lengths)
    cv = write_layer(cache.v, 0, v, cache.lengths)
    b, t = hidden.shape[:2]
    if "packed_kernels" in params and b * t <= cpu_kernels.MAX_ROWS and cpu_kernels.attention_supported(ck.dtype, cfg.head_dim):
        # the CPU kernel reads the committed slots and the row's ancestors only (XLA's scores the whole capacity)
        anc = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)) if parents is None else ancestor_mask(parents)
        attn = cpu_kernels.tree_attention(q, ck, cv, 0, cache.lengths, anc, 1.0 / float(np.sqrt(cfg.head_dim)),
                                          token_major=True)
    else:
        attn = xla_attention(q, ck[0], cv[0], cache.lengths, parents, "reference")
    return finish(params, cfg, hidden, attn), cache.replace(k=ck, v=cv)


def logits(params: dict, cfg: Eagle3Config, h: jax.Array, emb: jax.Array | None = None) -> jax.Array:
    """Draft-vocabulary logits [..., V_d] of the token after the one h was computed with (whose
    embedding `emb` [..., H] the fused read-out also reads)."""
    if cfg.readout == "fused":
        from hsd_jax.models.drafter import _unit_rms, fused_readout

        h = fused_readout(params["inject"], h.astype(jnp.float32), [_unit_rms(emb)], cfg.readout_scale)
    y = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps).astype(jnp.float32)
    return _dense(params, "lm_head", y, params["lm_head"]["kernel"].astype(jnp.float32))


def embedding(params: dict, target_embedding: jax.Array) -> jax.Array:
    """The token embedding table it reads: its own when the checkpoint has one, else the target's."""
    return params["embed_tokens"]["embedding"] if "embed_tokens" in params else target_embedding


# ---------------------------------------------------------------------------------------------
# The published format: config.json + model.safetensors (PyTorch [out, in] weights).
# ---------------------------------------------------------------------------------------------

def is_published_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "drafter.json"))


def published_config(d: dict, target_cfg: ModelConfig, source: str) -> Eagle3Config:
    archs = d.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelLoadError(f"{source}: architectures must be a list, got {json_repr(archs)}")
    if archs and not set(map(str, archs)) & set(ARCHITECTURES):
        raise ModelLoadError(f"{source}: architectures {archs} is not an EAGLE-3 drafter ({', '.join(ARCHITECTURES)})")
    switched = [k for k in UNSUPPORTED_SWITCHES if d.get(k)]
    if switched:
        raise ModelLoadError(f"{source}: {switched[0]}: true is an EAGLE-3 variant whose layer is not supported "
                             "(only the published EAGLE-3 layer is)")
    if d.get("num_hidden_layers", 1) != 1:
        raise ModelLoadError(f"{source}: an EAGLE-3 drafter has one decoder layer, config says "
                             f"num_hidden_layers={d.get('num_hidden_layers')}")
    try:
        eagle = d.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ConfigError(f"eagle_config must be a JSON object, got {json_repr(eagle)}")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        heads, hidden = d["num_attention_heads"], d["hidden_size"]
        head_dim = d.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                         and heads > 0 else None)
        return from_json(Eagle3Config, dict(
            hidden_size=hidden, num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim, intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or hidden,
            feature_layers=ids if ids else Eagle3Config.default_layers(target_cfg.num_layers),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_hf(rope), rms_norm_eps=d.get("rms_norm_eps", 1e-6)), "config.json")
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks the field {e.args[0]!r}") from None
    except (ConfigError, AttributeError) as e:
        raise ModelLoadError(f"{source}: {e}") from None


def load_published(path: str, target_cfg: ModelConfig) -> tuple[dict, Eagle3Config, np.ndarray]:
    """(params, config, d2t as draft id -> target id) from a published EAGLE-3 directory.
    Reads safetensors only: a pickle checkpoint is refused with a conversion route."""
    from hsd_jax.loading.hf import has_pickle_weights, open_safetensors, read_json, read_tensor

    source = os.path.join(path, "config.json")
    raw = read_json(source)
    weights = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights):
        if has_pickle_weights(path):
            raise ModelLoadError(
                f"{path}: only a pickle checkpoint (pytorch_model.bin) is there; hsd-jax never unpickles (it can run "
                "code). Convert it once where you trust the file: python -c \"import torch; from safetensors.torch "
                "import save_file; save_file(torch.load('pytorch_model.bin', weights_only=True), "
                "'model.safetensors')\"")
        raise ModelLoadError(f"{path}: no model.safetensors")
    f = open_safetensors(weights)
    with reading(weights, "tensor unreadable"):
        tensors = {k.removeprefix("model."): (f.get_tensor(k) if k.removeprefix("model.") in INDEX_TENSORS
                                              else read_tensor(f, weights, k)) for k in f.keys()}
    cfg = published_config(raw, target_cfg, source)

    def get(name, shape=None):
        if name not in tensors:
            raise ModelLoadError(f"{weights}: tensor {name} is missing (found: {', '.join(sorted(tensors)[:12])} ...)")
        x = tensors[name]
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise ModelLoadError(f"{weights}: {name} has shape {tuple(x.shape)}, config.json implies {tuple(shape)}")
        return x

    h, hq, hkv, inter = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                         cfg.intermediate_size)
    lin = lambda name, out, inp: {"kernel": np.ascontiguousarray(get(name + ".weight", (out, inp)).astype(np.float32).T)}
    norm = lambda name: {"scale": get(name + ".weight", (h,)).astype(np.float32)}
    mid = {k: norm("midlayer." + k) for k in LAYER_KEYS}
    if "midlayer.self_attn.q_norm.weight" in tensors or "Qwen3ForCausalLMEagle3" in (raw.get("architectures") or ()):
        mid.update({k: {"scale": get(f"midlayer.self_attn.{k}.weight", (cfg.head_dim,)).astype(np.float32)}
                    for k in QK_NORMS})
        cfg = dataclasses.replace(cfg, qk_norm=True)
    mid.update(q_proj=lin("midlayer.self_attn.q_proj", hq, 2 * h), k_proj=lin("midlayer.self_attn.k_proj", hkv, 2 * h),
               v_proj=lin("midlayer.self_attn.v_proj", hkv, 2 * h), o_proj=lin("midlayer.self_attn.o_proj", h, hq),
               mlp={n: lin("midlayer.mlp." + n, *s) for n, s in
                    (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))})
    params = {"fc": lin("fc", h, 3 * cfg.target_hidden_size), "midlayer": mid, "norm": norm("norm"),
              "lm_head": lin("lm_head", cfg.vd, h)}
    if "embed_tokens.weight" in tensors:
        params["embed_tokens"] = {"embedding": get("embed_tokens.weight", (cfg.vocab_size, h)).astype(np.float32)}
        cfg = dataclasses.replace(cfg, own_embedding=True)
    if "d2t" in tensors:
        offsets = get("d2t", (cfg.vd,))
        if not np.issubdtype(offsets.dtype, np.integer):
            raise ModelLoadError(f"{weights}: d2t has dtype {offsets.dtype}; it holds integer id offsets")
        offsets = offsets.astype(np.int64)
        d2t = np.arange(cfg.vd, dtype=np.int64) + offsets
    elif cfg.vd == cfg.vocab_size:
        d2t = np.arange(cfg.vd, dtype=np.int64)
    else:
        raise ModelLoadError(f"{weights}: no d2t map for a draft vocabulary of {cfg.vd} < {cfg.vocab_size}")
    if d2t.min() < 0 or d2t.max() >= cfg.vocab_size:
        raise ModelLoadError(f"{weights}: d2t maps draft ids outside the target vocabulary of {cfg.vocab_size}")
    return params, cfg, d2t.astype(np.int32)


def export_published(params: dict, cfg: Eagle3Config, d2t, path: str, dtype: str = "float32") -> None:
    """Write a drafter in the published format (config.json + model.safetensors, [out, in] weights,
    d2t as offsets, t2d), so other engines load what we train; `load_published` reads it back
    exactly. In a multi-process run only process 0 writes."""
    from safetensors.numpy import save_file

    from hsd_jax.distributed import is_primary

    if cfg.readout != "plain":
        raise ConfigError(f"an eagle3 drafter with the {cfg.readout!r} read-out (an ablation) has no published format")
    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), params)
    mid = host["midlayer"]
    out_in = lambda a: np.ascontiguousarray(a.T).astype(np_dtype)
    d2t = np.asarray(d2t, np.int64)
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[d2t] = True
    tensors = {"fc.weight": out_in(host["fc"]["kernel"]), "norm.weight": host["norm"]["scale"].astype(np_dtype),
               "lm_head.weight": out_in(host["lm_head"]["kernel"]),
               "d2t": d2t - np.arange(cfg.vd, dtype=np.int64), "t2d": t2d}
    tensors.update({f"midlayer.{k}.weight": mid[k]["scale"].astype(np_dtype) for k in LAYER_KEYS})
    tensors.update({f"midlayer.self_attn.{k}.weight": out_in(mid[k]["kernel"])
                    for k in ("q_proj", "k_proj", "v_proj", "o_proj")})
    tensors.update({f"midlayer.mlp.{k}.weight": out_in(v["kernel"]) for k, v in mid["mlp"].items()})
    if cfg.qk_norm:
        tensors.update({f"midlayer.self_attn.{k}.weight": mid[k]["scale"].astype(np_dtype) for k in QK_NORMS})
    if "embed_tokens" in host:
        tensors["embed_tokens.weight"] = host["embed_tokens"]["embedding"].astype(np_dtype)
    rope = dataclasses.asdict(cfg.rope_scaling)
    arch, mtype = ("Qwen3ForCausalLMEagle3", "qwen3") if cfg.qk_norm else ("LlamaForCausalLMEagle3", "llama")
    config = {"architectures": [arch], "model_type": mtype, "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
              "draft_vocab_size": cfg.vd, "target_hidden_size": cfg.target_hidden_size,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
              "rope_scaling": None if rope["rope_type"] == "default" else rope, "tie_word_embeddings": False,
              "torch_dtype": dtype, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers)}}
    if is_primary():
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
