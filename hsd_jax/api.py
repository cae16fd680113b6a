"""The stable public API: `load_target` and `generate`."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax import compilation, cpu_kernels, distributed, host_memory, kernel_build, sharding
from hsd_jax.config import ConfigError, InputError, ModelConfig, SamplingConfig, from_json
from hsd_jax.loading.errors import ModelLoadError, read_npy
from hsd_jax.models import llama
from hsd_jax.models.drafter import Drafter


@dataclasses.dataclass
class Target:
    """A loaded target model: explicit params pytree, its config and tokenizer."""

    params: Any
    config: ModelConfig
    tokenizer: Any
    max_cache_len: int
    name: str
    _packed: Any = dataclasses.field(default=None, repr=False, compare=False)   # (params, their cpu_kernels packed copies)
    _source: Any = dataclasses.field(default=None, repr=False, compare=False)   # (GGUF path, the params read from it)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(self.tokenizer.encode(prompt))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: dict


def default_dtype() -> str:
    """f32 on CPU (no native bf16 there), bf16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def model_path(model: str) -> str:
    """The file or directory `model` names: the embedded default's GGUF, a .gguf file or a HF directory."""
    from hsd_jax.loading.gguf_loader import DEFAULT_MODEL, default_gguf_path

    if model == DEFAULT_MODEL:
        return default_gguf_path()
    if os.path.exists(model):
        return model
    raise ModelLoadError(f"unknown model {model!r}: give {DEFAULT_MODEL!r}, a .gguf file "
                         "or a Hugging Face model directory")


def load_target(model: str = "smollm2-135m", *, dtype: str | None = None, max_cache_len: int = 2048,
                attention_impl: str = "auto", feature_layers: Sequence[int] = (),
                tokenizer: bool = True, mesh=None) -> Target:
    """Load the embedded default (`smollm2-135m`), a .gguf file or a Hugging Face directory.

    With a `mesh`, weights go from host memory straight into their shards (partition rules of
    `hsd_jax.sharding`), never whole onto one device."""
    from hsd_jax.loading.gguf_loader import load_gguf
    from hsd_jax.loading.hf import load_hf_dir
    from hsd_jax.loading.tokenizer import load_tokenizer

    if int(max_cache_len) <= 0:
        raise ConfigError(f"max_cache_len must be positive, got {max_cache_len}")
    if kernel_build.libtpu_without_tpu():   # JAX's choice too, without libtpu's logged failure
        compilation.use_cpu_backend()
    if kernel_build.cpu_likely():    # before anything starts JAX's backend and its threads (`host_memory`)
        host_memory.enable()
    compilation.enable()
    if mesh is None:   # a first process compiles the kernels while the weights load (a mesh run uses none)
        cpu_kernels.prebuild()
    if jax.default_backend() == "cpu":
        host_memory.enable()
    overrides = dict(dtype=dtype or default_dtype(), attention_impl=attention_impl,
                     feature_layers=tuple(feature_layers))
    path = model_path(model)
    loader = load_gguf if path.endswith(".gguf") else load_hf_dir
    try:
        cfg, params = loader(path, host=mesh is not None, **overrides)
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if mesh is not None:
        sharding.check_mesh(cfg, mesh, None, "target")
        params = sharding.shard_params(params, mesh)
    tok = load_tokenizer(path) if tokenizer else None
    if tok is not None and tok.eos_token_id is not None and tok.eos_token_id not in cfg.eos_token_ids:
        cfg = cfg.replace(eos_token_ids=cfg.eos_token_ids + (int(tok.eos_token_id),))
    source = (path, params) if loader is load_gguf and mesh is None else None   # weights_cache keys derived arrays by it
    return Target(params, cfg, tok, int(max_cache_len), model, _source=source)


PROMPT_BUCKET = 16  # the smallest prompt bucket: prompts are right-padded to PROMPT_BUCKET x 2^k tokens


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def cache_capacity(target: "Target") -> int:
    """The KV cache slots of every decode program for this target (`max_cache_len`, a multiple
    of 16): fixed per target, so no prompt length or `max_new_tokens` recompiles the loop."""
    return round_up(target.max_cache_len, 16)


def prompt_bucket_length(n: int, smallest: int = PROMPT_BUCKET, capacity: int | None = None) -> int:
    """The padded length of a prompt of n tokens: the least smallest x 2^k >= n (at most `capacity`),
    so prompts of 33-185 tokens share 3 prefill programs at a bucket of 16 and waste under half."""
    length = smallest
    while length < n:
        length *= 2
    return length if capacity is None else min(length, capacity)


def prompt_buckets(capacity: int, smallest: int = PROMPT_BUCKET, longest: int | None = None) -> list[int]:
    """Every padded prompt length a target of this capacity prefills (up to `longest` tokens' bucket)."""
    top = prompt_bucket_length(min(longest or capacity, capacity), smallest, capacity)
    out = [min(smallest, capacity)]
    while out[-1] < top:
        out.append(min(out[-1] * 2, capacity))
    return out


def _as_list(prompts) -> list:
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def check_request(prompts, max_new_tokens: int, prompt_bucket: int = PROMPT_BUCKET) -> None:
    """The checks on a request that need no model (the CLI runs them before loading one)."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_bucket < 1:
        raise InputError(f"prompt_bucket must be >= 1, got {prompt_bucket}")
    prompts = _as_list(prompts)
    if not prompts:
        raise InputError("no prompts given")
    for i, p in enumerate(prompts):
        if (isinstance(p, str) and not p.strip()) or len(p) == 0:
            raise InputError(f"prompt {i} is empty")


def encode_prompts(target: Target, prompts, chat: bool) -> list[list[int]]:
    """Token ids per prompt of a request `check_request` passed; prompts are strings or lists of token ids."""
    ids = []
    for i, p in enumerate(_as_list(prompts)):
        if isinstance(p, str):
            if target.tokenizer is None:
                raise InputError("this target has no tokenizer: pass token ids")
            p = target.encode(p, chat)
        p = [int(t) for t in p]
        if not p:
            raise InputError(f"prompt {i} is empty")
        if max(p) >= target.config.vocab_size or min(p) < 0:
            raise InputError(f"prompt {i} has token ids outside [0, {target.config.vocab_size})")
        ids.append(p)
    return ids


def pad_prompts(ids: list[list[int]], smallest: int = PROMPT_BUCKET,
                capacity: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to the longest prompt's bucket (`prompt_bucket_length`: one prefill program per
    bucket); returns tokens [B, T] and lengths [B]."""
    t = prompt_bucket_length(max(len(p) for p in ids), smallest, capacity)
    tokens = np.zeros((len(ids), t), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    return tokens, np.asarray([len(p) for p in ids], np.int32)


_COMPILED: dict = {}


SMALL_PROGRAM_PARAMS = 1 << 20
# XLA:CPU options for programs over tiny models: their steps take microseconds, so LLVM's
# optimiser never pays back the ~40% of compile time it costs, nor the MLIR fusion emitters the
# ~35% of what remains (tests, toy models; both measured on a tiny hsd decode loop).
FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                        "xla_cpu_use_fusion_emitters": False}
# XLA:CPU options for larger models served on the CPU kernels (`cpu_kernels`): their matmuls and
# attention run there, so what XLA compiles is small elementwise fusions and the prefill's library
# dots, which neither the MLIR fusion emitters nor LLVM's expensive passes speed up measurably;
# without them SmolLM2's hsd decode loop compiles in ~2.7 s instead of ~3.9 s, its decode and
# prefill times unchanged within noise (measured side by side; BENCHMARKS.md, "Start-up").
KERNEL_PROGRAM_OPTIONS = {"xla_llvm_disable_expensive_passes": True, "xla_cpu_use_fusion_emitters": False}
VOCAB_TABLES = ("embed_tokens", "lm_head")
# A bf16 model on the CPU: XLA may otherwise keep a fusion's intermediates in f32 instead of rounding
# them to bf16 (excess precision), differently in each program (ar's loop, a method's rounds), so
# methods would stop matching ar; with every bf16 value rounded they compute the same bf16 model.
BF16_EXACT_OPTIONS = {"xla_allow_excess_precision": False}


def compile_options(params, kernels: bool = False) -> dict:
    """XLA compiler options for a decode loop over `params`: FAST_COMPILE_OPTIONS on the CPU for
    models whose decoder (the vocabulary tables left out: the embedding is a gather and the head
    one library dot at any optimisation level) has under SMALL_PROGRAM_PARAMS parameters,
    KERNEL_PROGRAM_OPTIONS for larger ones' programs that run the CPU `kernels` (prefill and decode
    without a mesh) when those are on, none (XLA's defaults) otherwise (e.g. training steps: their
    dots and fusions are XLA's). A 2-layer model with SmolLM2's 49k vocabulary compiles in half the time this way
    and still runs a 16-token decode in a fifth of a second (measured)."""
    if jax.default_backend() != "cpu":
        return {}
    body = {k: v for k, v in params.items() if k not in VOCAB_TABLES} if isinstance(params, dict) else params
    leaves = jax.tree.leaves(body)
    size = sum(int(np.prod(getattr(x, "shape", ()))) for x in leaves)
    if size < SMALL_PROGRAM_PARAMS:
        options = dict(FAST_COMPILE_OPTIONS)
    else:
        options = dict(KERNEL_PROGRAM_OPTIONS) if kernels and cpu_kernels.expected() else {}
    if any(getattr(x, "dtype", None) == jnp.bfloat16 for x in leaves):
        options.update(BF16_EXACT_OPTIONS)
    return options


def serving_params(target: Target, ready: bool = False) -> dict:
    """The target's params for decoding: with the packed layer weights of `hsd_jax.cpu_kernels`
    (built once per Target) when the kernels are enabled, else as loaded. An f32 model adds its
    tied LM head's bf16 screen (`head_screen`), a bf16 model its whole LM head in bf16 (`head`).

    While a first process's kernel build still runs they come packed for it without waiting
    (`generate` lowers ahead, `compiled` waits). `ready`: for a program jitted outside `generate`
    (`hsd tune`, benchmarks): wait for that build and its kernels' registration first, and leave the
    packed copies out if it failed (else XLA finds no handler for the kernels' calls)."""
    if target.config.dtype not in ("float32", "bfloat16") or not cpu_kernels.wanted():
        return target.params
    if target._packed is None or target._packed[0] is not target.params:   # packed while a first process's
        target._packed = (target.params, _packed_target(target))            # kernel build still runs
    if not cpu_kernels.expected() or (ready and not cpu_kernels.enabled()):
        return target.params
    return dict(target.params, packed_kernels=target._packed[1])


def _packed_target(target: Target) -> dict:
    """The target's packed layers and tied head's screen (a bf16 target: its head, packed): read from the weights cache when its params
    are still those loaded from a GGUF file and an earlier load packed them (packing SmolLM2 takes
    ~1 s, mapping it back a fraction), else packed here and stored there for the next process. The
    cache variant names the params' dtype and a hash of the packing code (cpu_kernels/__init__.py),
    so packed copies of another layout are never read back. Fresh or mapped, the copies are committed
    to the CPU device (DLPack's arrays are), so both paths lower to the same programs and a process
    that maps them reuses the persistent compilation cache of the one that packed them."""
    import hashlib

    from hsd_jax.loading import weights_cache

    source = target._source[0] if target._source is not None and target._source[1] is target.params else None
    if source is not None:
        with open(cpu_kernels.__file__, "rb") as f:
            variant = f"packed-{target.config.dtype}-{hashlib.sha256(f.read()).hexdigest()[:16]}"
        cached = weights_cache.load_derived(source, variant)
        if cached is not None:
            return cached
    if source is not None:   # packed straight into the cache file, then served from its mapping
        packed = _packed_in_place(target, source, variant)
        if packed is not None:
            return packed
    packed = cpu_kernels.pack_layers(target.params["layers"])
    if target.config.dtype == "bfloat16":
        packed["head"] = cpu_kernels.on_cpu(cpu_kernels.pack_head(llama.lm_head_weight(target.params, target.config),
                                                                  jnp.bfloat16))
    elif target.config.tie_word_embeddings:
        embedding = target.params["embed_tokens"]["embedding"]
        packed["head_screen"] = cpu_kernels.on_cpu(cpu_kernels.pack_head_screen(embedding))
        packed["head_screen_norms"] = cpu_kernels.on_cpu(cpu_kernels.head_screen_norms(embedding))
    if source is not None:
        weights_cache.store_derived(source, variant, packed)
    cpu = jax.devices("cpu")[0]
    return {k: jax.device_put(v, cpu) for k, v in packed.items()}


def _packed_in_place(target: Target, source: str, variant: str) -> dict | None:
    """`_packed_target`'s arrays packed into a new weights-cache file (`weights_cache.create`: no
    second copy to write out) and mapped back from it; None when the cache cannot take them."""
    from hsd_jax.loading import weights_cache

    layers, cfg = target.params["layers"], target.config
    layout = cpu_kernels.layers_layout(layers)
    head = "head" if cfg.dtype == "bfloat16" else "head_screen" if cfg.tie_word_embeddings else None
    if head:
        layout[head] = cpu_kernels.head_layout(cfg.hidden_size, cfg.vocab_size, cfg.dtype)
    if head == "head_screen":
        layout["head_screen_norms"] = ((2, cfg.vocab_size), np.dtype(np.float32))
    file = weights_cache.create(source, variant, layout)
    if file is None:
        return None
    try:
        cpu_kernels.pack_layers(layers, into=file.arrays)
        if head == "head":
            cpu_kernels.pack_head(llama.lm_head_weight(target.params, cfg), jnp.bfloat16, into=file.arrays[head])
        elif head:
            cpu_kernels.pack_head_screen(target.params["embed_tokens"]["embedding"], into=file.arrays[head])
            cpu_kernels.head_screen_norms(target.params["embed_tokens"]["embedding"], into=file.arrays["head_screen_norms"])
    except BaseException:
        file.discard()
        raise
    mapped = weights_cache.load_derived(source, variant) if file.commit() else None
    return mapped if mapped is not None else {k: cpu_kernels.on_cpu(v) for k, v in file.arrays.items()}


# The feature drafters' weights on the CPU kernels: bf16 (half the bytes a pass streams; widened
# exactly in registers, f32 sums). They only propose tokens, so their rounding moves acceptance,
# never an output (BENCHMARKS.md, "The drafter's share of a round").
DRAFTER_KERNEL_DTYPE = "bfloat16"


def serving_drafter_params(drafter: Drafter, target: Target, dtype: str | None = None):
    """A feature drafter's (hsd, eagle) params for decoding beside `serving_params(target)`: with
    its layers' packed weights and its draft-vocab head packed (`packed_kernels["draft_head"]`,
    read through `TargetView.packed_head`) in `dtype` (default DRAFTER_KERNEL_DTYPE), built once
    per drafter, target and dtype, when the target is served with the CPU kernels (f32 or bf16);
    sd's draft LM with its layers packed in its own dtype (a draft LM's forward is the target's);
    EAGLE-3's fc, layer and head in `dtype` (`_served_eagle3`); else as loaded."""
    from hsd_jax.models.drafter import DrafterConfig, pack_draft_head, pack_readout
    from hsd_jax.models.eagle3 import Eagle3Config

    params = drafter.params
    served = target.config.dtype in ("float32", "bfloat16") and cpu_kernels.expected()   # as `serving_params`
    if isinstance(drafter.config, ModelConfig) and drafter.config.dtype == target.config.dtype and served:
        # sd's draft LM: its layers through the kernels as the target's, so its attention reads the
        # committed slots only (XLA's scores every slot of the cache capacity)
        if drafter._packed is None or drafter._packed[0] is not params:
            drafter._packed = (params, None, None, cpu_kernels.pack_layers(params["layers"]))
        return dict(params, packed_kernels=drafter._packed[-1])
    if isinstance(drafter.config, Eagle3Config) and served:
        return _served_eagle3(drafter, jnp.dtype(dtype or DRAFTER_KERNEL_DTYPE))
    if (not isinstance(drafter.config, DrafterConfig) or not served
            or params["layers"]["mlp"]["down_proj"]["kernel"].dtype not in cpu_kernels.DTYPES):
        return params
    dtype = jnp.dtype(dtype or DRAFTER_KERNEL_DTYPE)
    key = drafter._packed
    if key is None or key[0] is not params or key[1] is not target.params or key[2] != dtype:
        packed = cpu_kernels.pack_layers(params["layers"], dtype)
        head = pack_draft_head(target.params, target.config, drafter.d2t, dtype)
        if head is not None:
            packed["draft_head"] = head
        if drafter.config.uses_fused_readout:
            packed.update(pack_readout(params["inject"], dtype))
        drafter._packed = (params, target.params, dtype, packed)
    return dict(params, packed_kernels=drafter._packed[-1])


def _served_eagle3(drafter: Drafter, dtype) -> dict:
    """An EAGLE-3 drafter's params with its layer's, fc's and head's weights packed for the CPU kernels
    (`eagle3.PACKED`, as [1, f / 32, d, 32] in `dtype`, the output widths zero-padded to whole tiles),
    built once per drafter and dtype."""
    from hsd_jax.models import eagle3

    params = drafter.params
    key = drafter._packed
    if key is None or key[0] is not params or key[2] != dtype:
        packed = {name: cpu_kernels.on_cpu(cpu_kernels.pack_head(w, dtype))
                  for name, w in eagle3.kernels_of(params).items() if w.dtype in cpu_kernels.DTYPES}
        drafter._packed = (params, None, dtype, packed)
    return dict(params, packed_kernels=drafter._packed[-1])


def compiled(fn, args, static: dict, options: dict | None = None):
    """AOT-compile `fn` for these argument shapes once per process (with XLA compiler `options`;
    from the persistent compilation cache when an earlier process compiled it, `compilation`);
    returns (executable, compile seconds now)."""
    options = options or {}
    key = (*_program_key(fn, args, static), tuple(sorted(options.items())))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    compilation.enable()
    t0 = time.perf_counter()
    lowered = _LOWERED.pop(key[:-1], None) or fn.lower(*args, **static)
    if _uses_kernels(args) and not cpu_kernels.enabled():   # waits for a build still running
        raise cpu_kernels.Unavailable("the CPU kernel library failed to build")
    exe = lowered.compile(compiler_options=options or None)
    _COMPILED[key] = exe
    return exe, time.perf_counter() - t0


def _program_key(fn, args, static: dict) -> tuple:
    """What a program's compile depends on but its compiler options: the function, the arguments'
    tree, shapes, dtypes and placements, the static arguments and the mesh in use."""
    shapes = jax.tree.map(lambda a: (np.shape(a), str(getattr(a, "dtype", type(a))),
                                     str(getattr(a, "sharding", None))), args)
    return (fn, str(jax.tree.structure(args)), str(shapes), tuple(sorted(static.items())),
            str(jax.sharding.get_abstract_mesh()))


_LOWERED: dict = {}   # programs lowered ahead of their compile (`_lower_ahead`), by `compiled`'s key less options


def _uses_kernels(args) -> bool:
    """Whether a program's arguments carry packed weights for the CPU kernels (`serving_params`)."""
    return any(isinstance(a, dict) and "packed_kernels" in a for a in args)


def _lower_ahead(progs: "Programs", args: tuple, n: int, bound) -> float:
    """While the kernel library still builds (a first process), lower the prefill and the decode loop
    before either compiles: the loop's cache argument is shaped from the lowered prefill's outputs,
    placed as they will be (one CPU device). Lowering waits for no build; `compiled` takes these.
    Returns the seconds spent (0 when there is no build to overlap)."""
    if not (_uses_kernels(args) and cpu_kernels.building()):
        return 0.0
    t0 = time.perf_counter()
    pkey = _program_key(progs.prefill, args, progs.prefill_static)
    if pkey not in _LOWERED:
        _LOWERED[pkey] = progs.prefill.lower(*args, **progs.prefill_static)
    lowered = _LOWERED[pkey]
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    pre = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=cpu), lowered.out_info)
    dargs = (*args[:n], pre, bound)
    dkey = _program_key(progs.decode, dargs, progs.decode_static)
    if dkey not in _LOWERED:
        _LOWERED[dkey] = progs.decode.lower(*dargs, **progs.decode_static)
    return time.perf_counter() - t0


ORBAX_COMMIT_MARKER = "commit_success.txt"  # written by Orbax beside a checkpoint: "... successful to /abs/dir"


def _drafter_paths(path: str) -> tuple[str, str, str]:
    return os.path.join(path, "drafter.json"), os.path.join(path, "d2t.npy"), os.path.join(path, "params")


def save_drafter(drafter, path: str) -> None:
    """Write a drafter as drafter.json (kind, config) + d2t.npy + an Orbax params checkpoint.

    Multi-process: the params are gathered to every host (a drafter is small) and process 0 alone
    writes; the others wait for it, so all can read the result once this returns."""
    import json

    host = sharding.fetch(drafter.params)
    if distributed.is_primary():
        os.makedirs(path, exist_ok=True)
        meta, d2t_path, params_path = _drafter_paths(path)
        with open(meta, "w") as f:
            json.dump({"kind": drafter.kind, "config": dataclasses.asdict(drafter.config)}, f, indent=1)
        np.save(d2t_path, np.asarray(drafter.d2t if drafter.d2t is not None else [], np.int32))
        if jax.tree.leaves(host):  # a weightless drafter (lookup): its config is all there is
            with distributed.primary_checkpointer() as ckpt:
                ckpt.save(os.path.abspath(params_path), host, force=True)
            # Orbax's commit marker names this machine's absolute directory; a local restore does
            # not read it, and a drafter that ships in the package must not carry the path.
            marker = os.path.join(params_path, ORBAX_COMMIT_MARKER)
            if os.path.isfile(marker):
                os.remove(marker)
    distributed.barrier("save_drafter")


SHIPPED_DRAFTERS = os.path.join(os.path.dirname(__file__), "drafters")


def shipped_drafter(kind: str, target: Target) -> str | None:
    """The trained drafter shipped in the package for this target, if there is one."""
    path = os.path.join(SHIPPED_DRAFTERS, target.name, kind)
    return path if os.path.isfile(os.path.join(path, "drafter.json")) else None


_DRAIN_SECONDS = 60.0   # how long a closing restore loop waits for reads still in flight


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that finishes the tasks it still holds before it closes.

    Orbax runs each restore in a fresh loop and closes it when its `gather` of reads returns. When one
    read of a damaged checkpoint fails, `gather` raises at once while TensorStore's other reads are in
    flight: their completions then call back into the closed loop from TensorStore's threads (an
    "Event loop is closed" traceback on stderr, after or before the one-line error) and their tasks'
    failures are reported whenever the garbage collector finds them. Draining here leaves nothing in
    flight; the first failure is the one reported, the others are retrieved (not news)."""

    def close(self) -> None:
        pending = [t for t in asyncio.all_tasks(self) if not t.done()]
        if pending and not self.is_running() and not self.is_closed():
            self.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_SECONDS))
            for t in pending:
                if t.done() and not t.cancelled():
                    t.exception()
        super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _DrainingLoop()


def _restore_params(path: str):
    """An Orbax params checkpoint, restored onto this process's first device whatever topology saved it.
    Restored eagerly, so a damaged file (TensorStore's read errors included) is a ModelLoadError here.
    The restore's event loops are `_DrainingLoop`s (Orbax makes them with `asyncio.new_event_loop`),
    in a thread of its own when this one runs a loop (a notebook: Orbax would use uvloop there)."""
    import logging

    from hsd_jax.loading.errors import one_line

    if not os.path.isdir(path):
        raise ModelLoadError(f"drafter weights not found: {path}")
    absl = logging.getLogger("absl")   # Orbax logs what it fails to parse: the error below says it once
    level, policy = absl.level, asyncio.get_event_loop_policy()
    absl.setLevel(logging.CRITICAL)
    asyncio.set_event_loop_policy(_DrainingPolicy())
    try:
        try:
            return _outside_running_loop(lambda: _restore_checkpoint(path))
        except Exception as e:   # Orbax and TensorStore raise bare Exceptions on damaged files
            failure = one_line(e)
    finally:
        asyncio.set_event_loop_policy(policy)
        absl.setLevel(level)
    raise ModelLoadError(f"{path}: damaged Orbax checkpoint: {failure}")


ORBAX_CACHE_VARIANT = "orbax"


def _restore_cached(path: str, compute):
    """`_restore_params`; on the CPU backend read from the weights cache when an earlier load left a
    valid copy of the checkpoint's arrays there (no Orbax import or restore: ~0.5 s of a short
    command), their floats widened to `compute` on the host (as `load_drafter` would on the device:
    the same values), else restored and copied there. Only a tree of arrays in nested dicts (a Flax
    params tree) is cached."""
    from hsd_jax.loading import weights_cache

    cached = jax.default_backend() == "cpu" and os.path.isdir(path)
    if cached:
        flat = weights_cache.load_host(path, ORBAX_CACHE_VARIANT)
        if flat is not None:
            dev = jax.local_devices()[0]
            return weights_cache.unflatten({k: jax.device_put(v.astype(compute) if jnp.issubdtype(v.dtype, jnp.floating)
                                                              else v, dev) for k, v in flat.items()})
    params = _restore_params(path)
    flat = weights_cache.flatten(params) if isinstance(params, dict) else {}
    if (cached and flat and all(isinstance(v, jax.Array) for v in flat.values())
            and jax.tree.structure(weights_cache.unflatten(flat)) == jax.tree.structure(params)):
        weights_cache.store_derived(path, ORBAX_CACHE_VARIANT, {k: np.asarray(v) for k, v in flat.items()})
    return params


def _outside_running_loop(fn):
    """fn(), in a worker thread if this thread is running an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def _restore_checkpoint(path: str):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        meta_tree = ckpt.metadata(os.path.abspath(path))
        meta_tree = getattr(meta_tree, "item_metadata", meta_tree)
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), meta_tree)
        return ckpt.restore(os.path.abspath(path), abstract)


def export_eagle3(path: str, out: str, dtype: str = "float32") -> None:
    """Write an eagle3 drafter saved by `save_drafter` (e.g. by `hsd train`) in the published
    EAGLE-3 format, loadable by the EAGLE reference, SpecForge, sglang and vLLM (and by
    `load_drafter("eagle3", out, ...)` again). No target needed."""
    from hsd_jax.models import eagle3

    if dtype not in ("float32", "float16"):
        raise ConfigError(f"export dtype must be float32 or float16, got {dtype!r}")
    info = _drafter_info(path, "eagle3")
    _, d2t_path, params_path = _drafter_paths(path)
    cfg = _drafter_config(path, info, lambda raw: from_json(eagle3.Eagle3Config, raw))
    eagle3.export_published(_restore_params(params_path), cfg, read_npy(d2t_path), out, dtype)


def _drafter_info(path: str, kind: str) -> dict:
    """drafter.json of a drafter directory, checked to hold a `kind` drafter and its config object."""
    from hsd_jax.loading.hf import read_json

    meta = _drafter_paths(path)[0]
    if not os.path.isfile(meta):
        raise ModelLoadError(f"not a drafter directory (no drafter.json): {path}")
    info = read_json(meta)
    if info.get("kind") != kind:
        raise ModelLoadError(f"{path} holds a {info.get('kind')!r} drafter, not {kind!r}")
    if not isinstance(info.get("config"), dict):
        raise ModelLoadError(f"{meta}: no 'config' object (drafter.json holds the drafter's kind and config)")
    return info


def _drafter_config(path: str, info: dict, make, **overrides):
    """The drafter config `make` builds from drafter.json's (type-checked) fields."""
    try:
        return make(dict(info["config"], **overrides))
    except (ConfigError, TypeError) as e:
        raise ModelLoadError(f"{_drafter_paths(path)[0]}: {e}") from None


_EXPECTED_PARAMS: dict = {}   # (drafter kind, config, target config) -> expected weights, traced once


def _check_restored(params, dk, cfg, target, source: str) -> None:
    """Refuse restored weights whose tree, shapes or kinds (float / integer) differ from those the
    config implies (a damaged or foreign checkpoint), before anything compiles over them. The
    expected ones come from the kind's random init, traced without computing it."""
    describe = lambda tree: {jax.tree_util.keystr(k): (tuple(v.shape), bool(jnp.issubdtype(v.dtype, jnp.floating)))
                             for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    key = (dk, cfg, target.config)
    if key not in _EXPECTED_PARAMS:
        overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "kind"}
        _EXPECTED_PARAMS[key] = describe(jax.eval_shape(lambda: dk.random(target, 0, **overrides)[0]))
    have, want = describe(params), _EXPECTED_PARAMS[key]
    for name in sorted(set(have) | set(want)):
        if name not in have:
            raise ModelLoadError(f"{source}: weights lack {name}")
        if name not in want:
            raise ModelLoadError(f"{source}: unexpected weights {name}")
        if have[name] != want[name]:
            (hs, hf), (ws, wf) = have[name], want[name]
            raise ModelLoadError(f"{source}: weights {name} are {'float' if hf else 'integer'} {hs}, the config "
                                 f"implies {'float' if wf else 'integer'} {ws}")


def _as_dtype(x, dtype):
    """x in `dtype`; converted on the host when it lives there or on the CPU device (a new shape's
    `astype` compiles a program: a bf16 drafter's leaves cost ~0.4 s of a first process)."""
    if x.dtype == dtype:
        return x
    if isinstance(x, np.ndarray):
        return np.asarray(x, dtype)
    if x.is_fully_addressable and {d.platform for d in x.devices()} == {"cpu"}:
        return jax.device_put(np.asarray(x).astype(dtype), x.sharding)
    return x.astype(dtype)


def load_drafter(kind: str, path: str | None = None, *, target: Target, random_init: bool = False,
                 seed: int = 0, **config) -> Drafter:
    """A drafter for `target` and the method of the same name (`hsd_jax.methods.REGISTRY`):
    `hsd`, `eagle` (feature drafters), `eagle3` (EAGLE-3), `sd` (a small draft LM) or `ngram`
    (the bigram-table floor, built by `hsd data ngram`).

    From `path` (a directory written by `save_drafter`, or for eagle3 a published EAGLE-3
    checkpoint: config.json + model.safetensors), the drafter shipped for the target
    (`hsd_jax/drafters/<model>/<kind>`) when no path is given, or random weights when asked
    with `random_init=True` (for tests and engine checks; acceptance will be low). `config`
    overrides fields of the stored (or default) drafter config.
    """
    from hsd_jax import methods
    from hsd_jax.models.layers import jnp_dtype

    if kind not in methods.REGISTRY:
        raise ConfigError(f"drafter kind must be one of {', '.join(methods.REGISTRY)}, got {kind!r}")
    dk = methods.REGISTRY[kind].drafter
    if path is None and not random_init and not dk.built_in:
        path = shipped_drafter(kind, target)
        if path is None:
            raise ModelLoadError(f"no {kind} drafter given and none is shipped for {target.name!r}: pass "
                                 "path=... (a trained drafter directory) or random_init=True")
    published = dk.read(path, target) if path is not None and os.path.isdir(path) else None
    if published is not None:
        params, cfg, d2t = published
        if config:
            cfg = dataclasses.replace(cfg, **config)
    elif path is not None:
        _, d2t_path, params_path = _drafter_paths(path)
        cfg = _drafter_config(path, _drafter_info(path, kind), dk.config, **config)
        d2t = read_npy(d2t_path) if dk.has_draft_vocab and os.path.isfile(d2t_path) else None
        params = ({} if dk.built_in and not os.path.exists(params_path)
                  else _restore_cached(params_path, jnp_dtype(target.config)))
    else:
        params, cfg, d2t = dk.random(target, seed, **config)
    compute = jnp_dtype(target.config)  # drafters compute in the target's dtype
    params = jax.tree.map(lambda x: _as_dtype(x, compute) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    try:
        params, cfg, d2t = dk.finish(params, cfg, d2t, target)
    except (ConfigError, ModelLoadError) as e:   # a drafter read from files: the message names them
        if path is None or path in str(e):
            raise
        raise ModelLoadError(f"{path}: {e}") from None
    if path is not None and published is None:
        _check_restored(params, dk, cfg, target, params_path)
    return Drafter(kind, params, cfg, d2t, path)


def _shard_args(args, mesh, target: Target, drafter, batch: int):
    """Validate `mesh` for this target/drafter/batch and place the decode-loop arguments on it:
    target and drafter params by the partition rules, d2t and the key replicated, prompts over `data`."""
    sharding.check_mesh(target.config, mesh, batch, "target")
    if drafter is not None and isinstance(drafter.config, ModelConfig):  # a draft LM (sd)
        sharding.check_mesh(drafter.config, mesh, batch, "draft model")
    *weights, tokens, lengths, key = args
    placed = [sharding.shard_params(w, mesh) for w in weights[:2]] + [sharding.replicate(w, mesh) for w in weights[2:]]
    return (*placed, sharding.shard_batch(tokens, mesh), sharding.shard_batch(lengths, mesh),
            sharding.replicate(key, mesh))


def _method_spec(target: Target, method: str, drafter, tuned: bool, options: dict):
    """The `engine.SpecConfig` (None for ar) and drafter a request for `method` runs with."""
    from hsd_jax import engine, methods

    if method == "ar":
        if options:
            raise InputError(f"unknown options for method 'ar': {', '.join(sorted(options))}")
        return None, None
    m = methods.get(method)
    if drafter is None and m.drafter.built_in:
        drafter = load_drafter(method, target=target)
    if drafter is None:
        raise InputError(f"method {method!r} needs a drafter: hsd_jax.load_drafter({method!r}, ...)")
    if drafter.kind != method:
        raise InputError(f"method {method!r} needs a {method!r} drafter, got a {drafter.kind!r} one")
    known = {f.name for f in dataclasses.fields(engine.SpecConfig)} - {"method"}
    unknown = set(options) - known
    if unknown:
        raise InputError(f"unknown options for method {method!r}: {', '.join(sorted(unknown))}")
    if tuned:
        from hsd_jax import tuning

        options = dict(tuning.tuned_options(method, target, drafter), **options)
    spec = engine.SpecConfig(method=method, **engine.spec_defaults(method, jax.default_backend(), options), **options)
    m.check(drafter, spec)
    return spec, drafter


@dataclasses.dataclass(frozen=True)
class Programs:
    """The two jitted programs a request runs (`hsd_jax.engine`), with their static arguments:

        prefill(*weights, tokens [B, T], lengths [B], key, **prefill_static) -> engine.Prefilled
            one program per padded prompt length T (`prompt_buckets`);
        decode(*weights, prefilled, max_new_tokens (int32 scalar), **decode_static) -> output
            one program per (model, method, spec, sampling, batch, capacity); it donates
            `prefilled` (its cache is written in place) and returns those buffers as `output.state`.

    weights: (target params,) for ar, (target params, drafter params, d2t) otherwise."""

    weights: tuple
    prefill: Any
    decode: Any
    prefill_static: dict
    decode_static: dict
    options: dict       # XLA compiler options (`compile_options`)
    capacity: int


def exact_rows(exact, spec) -> int:
    """The row width of every target forward after the prefill that `generate(..., exact=...)` asks
    for (0: each method's own: 1 for ar, the verify tree's for the others). True:
    `engine.EXACT_ROWS`; an int: that many rows, at least the method's verify tree."""
    from hsd_jax import engine

    if exact is False or exact is None:
        return 0
    if exact is True:
        rows = engine.EXACT_ROWS
    elif isinstance(exact, (int, np.integer)) and exact >= 1:
        rows = int(exact)
    else:
        raise InputError(f"exact must be True, False or a row count >= 1, got {exact!r}")
    if spec is not None and rows < spec.verify_slots:
        raise InputError(f"exact={exact!r}: {rows} rows are narrower than method {spec.method!r}'s verify tree "
                         f"of {spec.verify_slots} slots: pass exact=N with N >= {spec.verify_slots}")
    return rows


def programs(target: Target, spec, drafter, sampling: SamplingConfig, mesh=None, rows: int = 0) -> Programs:
    """The prefill and decode programs of `generate` for this target, method spec (None: ar),
    drafter and sampling; `rows` > 0: every decode or verify forward at that many rows (`exact_rows`),
    with `engine.EXACT_ATTENTION`."""
    from hsd_jax import engine

    capacity = cache_capacity(target)
    tparams = serving_params(target) if mesh is None else target.params
    exact = dict(rows=rows) if rows else {}
    # exact: attention reduces over each row's keys in position order, whatever the tree's layout
    tcfg = target.config.replace(attention_impl=engine.EXACT_ATTENTION) if rows else target.config
    if spec is None:
        return Programs((tparams,), engine.ar_prefill, engine.ar_decode,
                        dict(cfg=tcfg, sampling=sampling, capacity=capacity),
                        dict(cfg=tcfg, sampling=sampling, **exact), compile_options(target.params, kernels=mesh is None), capacity)
    if getattr(drafter.config, "feature_layers", ()):  # the drafter reads these target layers' outputs
        tcfg = tcfg.replace(feature_layers=drafter.config.feature_layers)
    d2t = np.zeros((1,), np.int32) if drafter.d2t is None else drafter.d2t
    dparams = serving_drafter_params(drafter, target) if mesh is None else drafter.params
    static = dict(tcfg=tcfg, dcfg=drafter.config, spec=spec, sampling=sampling)
    return Programs((tparams, dparams, d2t), engine.spec_prefill, engine.spec_decode,
                    dict(static, capacity=capacity), dict(static, **exact), compile_options(target.params, kernels=mesh is None), capacity)


def _run(progs: Programs, tokens, lengths, key, max_new_tokens: int, mesh, target: Target, drafter) -> tuple:
    """Prefill then decode (each compiled once per shape, `compiled`); returns (output on the host,
    {compile, prefill, decode: seconds})."""
    args = (*progs.weights, tokens, lengths, key)
    bound = np.int32(max_new_tokens)
    if mesh is not None:
        args = _shard_args(args, mesh, target, drafter, len(tokens))
        bound = sharding.replicate(bound, mesh)
    n = len(progs.weights)
    with sharding.use_mesh(mesh):
        ahead = _lower_ahead(progs, args, n, bound) if mesh is None else 0.0
        prefill, compile_p = compiled(progs.prefill, args, progs.prefill_static, progs.options)
        t0 = time.perf_counter()
        pre = jax.block_until_ready(prefill(*args))
        prefill_s = time.perf_counter() - t0
        dargs = (*args[:n], pre, bound)
        decode, compile_d = compiled(progs.decode, dargs, progs.decode_static, progs.options)
        t0 = time.perf_counter()
        out = sharding.fetch(decode(*dargs)._replace(state=None))
        decode_s = time.perf_counter() - t0
    return out, {"compile": ahead + compile_p + compile_d, "prefill": prefill_s, "decode": decode_s}


def warmup(target: Target, *, method: str = "ar", drafter=None, batch_size: int = 1, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, mesh=None, prompt_bucket: int = PROMPT_BUCKET,
           max_prompt_len: int | None = None, tuned: bool = False, progress: bool = True, exact: bool | int = False,
           **options) -> dict:
    """Compile ahead of serving what `generate` with these arguments will run: the prefill program
    of every prompt bucket (up to `max_prompt_len` tokens' bucket; default the cache capacity) and
    the decode loop, which then serves every prompt length and `max_new_tokens`. Programs land in
    this process's table and in the persistent compilation cache (`hsd_jax.compilation`), so a
    later process loads them instead of compiling. Returns {"programs": n, "compile_seconds": s}."""
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    if prompt_bucket < 1:
        raise InputError(f"prompt_bucket must be >= 1, got {prompt_bucket}")
    sampling = SamplingConfig(float(temperature), int(top_k), float(top_p))
    spec, drafter = _method_spec(target, method, drafter, tuned, options)
    return _without_kernels_if_unbuilt(lambda: _compile_ahead(
        programs(target, spec, drafter, sampling, mesh, exact_rows(exact, spec)), target, drafter, batch_size, mesh,
        prompt_bucket, max_prompt_len, progress, method))


def _without_kernels_if_unbuilt(attempt):
    """attempt(), which makes its programs and runs them; once more if they were made for CPU kernels
    whose build, still running then, failed (`cpu_kernels.expected`): the second makes them without."""
    try:
        return attempt()
    except cpu_kernels.Unavailable:
        _LOWERED.clear()
        return attempt()


def _compile_ahead(progs: Programs, target: Target, drafter, batch_size: int, mesh, prompt_bucket: int,
                   max_prompt_len: int | None, progress: bool, method: str) -> dict:
    """`warmup`'s work once the request's programs are known (also `generate(..., warmup=True)`)."""
    from tqdm import tqdm

    buckets = prompt_buckets(progs.capacity, prompt_bucket, max_prompt_len)
    bar = tqdm(total=len(buckets) + 1, desc=f"warmup {method}", unit="program",
               disable=not (progress and distributed.is_primary()))
    total = 0.0
    key = jax.random.key(0)
    for i, t in enumerate(buckets):
        tokens, lengths = np.zeros((batch_size, t), np.int32), np.ones((batch_size,), np.int32)
        if i == 0:   # the smallest bucket runs, its output shaping the decode loop's arguments
            _, secs = _run(progs, tokens, lengths, key, 1, mesh, target, drafter)
            total += secs["compile"]
            bar.update(2)
            continue
        args = (*progs.weights, tokens, lengths, key)
        if mesh is not None:
            args = _shard_args(args, mesh, target, drafter, batch_size)
        with sharding.use_mesh(mesh):
            total += compiled(progs.prefill, args, progs.prefill_static, progs.options)[1]
        bar.update(1)
    bar.close()
    return {"programs": len(buckets) + 1, "compile_seconds": total}


def generate(target: Target, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = False, method: str = "ar",
             drafter=None, mesh=None, prompt_bucket: int = PROMPT_BUCKET, tuned: bool = False,
             exact: bool | int = False, warmup: bool = False, **options) -> list[GenerationResult]:
    """Generate a continuation per prompt; one result per prompt.

    Two compiled programs run (`programs`): a prefill per prompt bucket, then one decode loop
    per method, spec, batch size and target (its cache capacity is `max_cache_len`), whatever
    the prompt lengths and `max_new_tokens`. `warmup` compiles them ahead of time.

    mesh: a `hsd_jax.sharding.make_mesh(data, model)` mesh to run on several devices: params
    are placed into their shards (heads / MLP / vocab over `model`), prompts and KV caches over
    `data` (the number of prompts must divide by it), and XLA partitions the loop. Pallas
    tree attention then runs per shard under `jax.shard_map`.

    tuned: take the tree (and hsd reuse) `hsd tune` chose for this hardware, target and drafter
    (`hsd_jax.tuning`); explicit options still win; ignored by ar.

    prompt_bucket: the smallest prompt bucket: prompts are right-padded to prompt_bucket x 2^k
    tokens (at most the cache capacity), each padded length one prefill program.

    exact: True (`engine.EXACT_ROWS` rows) or a row count N: every target forward after the
    prefill runs at N rows, ar's steps padded with inactive rows and each verify tree with
    unreachable slots, so a token's arithmetic (matmul shapes, attention row packing) is the same
    in ar's step and in any method's verify: what bf16 greedy identity between them needs on an
    accelerator (BENCHMARKS.md). Costs the wider forwards; a method's tree must fit in N.

    warmup: first compile what later calls with this method, drafter, sampling and number of
    prompts run, whatever their prompt lengths (`hsd_jax.warmup`: every prefill bucket and the decode
    loop, with a progress bar); its compile time is counted in the results' `compile_seconds`.
    """
    check_request(prompts, max_new_tokens, prompt_bucket)
    sampling = SamplingConfig(float(temperature), int(top_k), float(top_p))
    spec, drafter = _method_spec(target, method, drafter, tuned, options)
    rows = exact_rows(exact, spec)
    ids = encode_prompts(target, prompts, chat)
    longest = max(len(p) for p in ids)
    slack = 0 if spec is None else spec.cache_slack
    if rows:   # the padded forwards write scratch K/V up to `rows` slots past the committed length
        slack = max(slack, rows + (0 if spec is None else spec.verify_depth + 1))
    if longest + max_new_tokens + slack > target.max_cache_len:
        raise InputError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens}"
                         + (f" + draft tree {slack}" if slack else "")
                         + f" exceeds the cache capacity max_cache_len={target.max_cache_len}")

    def attempt():
        progs = programs(target, spec, drafter, sampling, mesh, rows)
        ahead = 0.0
        if warmup:
            ahead = _compile_ahead(progs, target, drafter, len(ids), mesh, prompt_bucket, None, True,
                                   method)["compile_seconds"]
        tokens, lengths = pad_prompts(ids, prompt_bucket, progs.capacity)
        out, secs = _run(progs, tokens, lengths, jax.random.key(seed), max_new_tokens, mesh, target, drafter)
        secs["compile"] += ahead
        return out, secs

    out, secs = _without_kernels_if_unbuilt(attempt)
    elapsed = secs["prefill"] + secs["decode"]
    results = []
    for i in range(len(ids)):
        n = int(out.num_tokens[i])
        new = [int(t) for t in out.tokens[i, :n]]
        if spec is None:
            rounds, hist, dsteps = n - 1, [n - 1], 0
        else:
            rounds, hist = int(out.stats.rounds[i]), [int(h) for h in out.stats.accepted_hist[i]]
            dsteps = int(out.stats.drafter_steps[i])
        stats = {"method": method, "new_tokens": n, "prompt_tokens": len(ids[i]), "target_forwards": rounds + 1,
                 "rounds": rounds, "tau": (n - 1) / rounds if rounds else 1.0, "drafter_forwards": dsteps,
                 "accepted_hist": hist, "seconds": elapsed, "compile_seconds": secs["compile"],
                 "prefill_seconds": secs["prefill"], "decode_seconds": secs["decode"],
                 "tokens_per_s": n / elapsed if elapsed > 0 else 0.0, "exact_rows": rows}
        if spec is not None:
            stats.update(reuse=spec.reuse, tree_nodes=spec.tree_nodes, tree_depth=spec.depth, tree_top_k=spec.tree_top_k,
                         lookup_slots=spec.lookup_slots, lookup_min_match=spec.lookup_min_match,
                         lookup_rounds=int(out.stats.lookup_rounds[i]), min_draft_prob=spec.min_draft_prob,
                         verified_slots=int(out.stats.verified_slots[i]))
        text = target.decode(new) if target.tokenizer is not None else ""
        results.append(GenerationResult(new, text, stats))
    return results
