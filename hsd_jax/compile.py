"""`hsd compile`: build the programs `generate` (and `hsd train`) would run on a TPU or a GPU, on a
machine that has neither, and report whether they compile, what kernels they hold and what they cost.

TPU: the `libtpu` wheel (`pip install -e '.[tpu-compile]'`) gives deviceless TPU topologies
(`jax.experimental.topologies.get_topology_desc`), and `jax.jit(f).lower(abstract args sharded over
their devices).compile()` runs the real TPU compiler, Mosaic (the Pallas kernels) included. The
programs are traced under `jax.set_mesh` over the topology's chips, which is where Pallas's TPU
lowering reads the chip kind (`get_abstract_mesh().abstract_device`), so no private hook is needed.
CUDA: `jax.export` lowers for `platforms=("cuda",)` (compiling needs the GPU itself), Triton kernels
included. Arguments are `jax.ShapeDtypeStruct`s with shardings: no weight is read or materialised.

The programs come from the functions `generate` and `train` call (`generate_programs`,
`train_programs`); attention is the Pallas kernel pinned to the platform ("pallas_tpu" /
"pallas_triton": `pallas_kernels.tree_attention.PINNED`), as "auto" picks it there.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hsd_jax import api, engine, methods, sharding
from hsd_jax.config import ConfigError, InputError, ModelConfig, RopeScaling, SamplingConfig

PLATFORM_IMPL = {"tpu": "pallas_tpu", "cuda": "pallas_triton"}
# The custom calls that carry the Pallas kernels: Mosaic's on TPU (compiled HLO), Triton's in the
# CUDA StableHLO lowering.
KERNEL_CALLS = {"tpu": {"mosaic": "tpu_custom_call"}, "cuda": {"triton": "__gpu$xla.gpu.triton"}}
TRAIN_KINDS = ("hsd", "eagle", "eagle3", "sd")


def _llama3(hidden: int, inter: int, layers: int, head_dim: int, factor: float, tie: bool) -> ModelConfig:
    return ModelConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=32,
                       num_kv_heads=8, head_dim=head_dim, rope_theta=500000.0, tie_word_embeddings=tie,
                       rope_scaling=RopeScaling("llama3", factor, 1.0, 4.0, 8192), max_position_embeddings=131072)


# Published architectures by shape alone (config.json of each release): `--model NAME-shape` compiles their
# programs with no files at all (what a bigger target would cost; drafters are random-initialised).
SHAPES = {"llama-3.2-1b-shape": _llama3(2048, 8192, 16, 64, 32.0, True),
          "llama-3.1-8b-shape": _llama3(4096, 14336, 32, 128, 8.0, False)}


class CompileSetupError(ConfigError):
    """The compile target cannot be set up here (libtpu missing, unknown topology, bad options)."""


@dataclasses.dataclass
class Program:
    """One program to build: `fn` (a jitted function) over abstract `args` and static `static`."""

    name: str
    fn: Callable
    args: tuple
    static: dict
    mesh: Any = None
    kernels_expected: bool = True   # the tree-attention kernel belongs in it (decode loops, not training)


@dataclasses.dataclass
class Result:
    name: str
    ok: bool
    error: str = ""
    kernels: dict = dataclasses.field(default_factory=dict)
    memory: dict | None = None
    cost: dict | None = None
    seconds: float = 0.0
    kernels_expected: bool = True


def tpu_devices(topology: str) -> list:
    """The deviceless TPU chips of `topology` (e.g. "v5e:2x2", "v4:2x2x1", "v3:2x2")."""
    # libtpu looks for a TPU VM's metadata server unless told not to, and refuses to start while
    # another process (any JAX process here, once libtpu is installed) holds its lock file.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")   # else libtpu logs an error about its absence
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise CompileSetupError("compiling for a TPU needs libtpu: pip install -e '.[tpu-compile]'") from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:   # libtpu's errors are runtime errors of several types
        raise CompileSetupError(f"TPU topology {topology!r} not available: {one_line(e)} (e.g. v5e:2x2, "
                                "v4:2x2x1, v3:2x2)") from None


def one_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def model_config(model: str, dtype: str, platform: str) -> tuple[ModelConfig, str]:
    """The target's config (no weights read; a name in SHAPES needs no file) with this dtype and the
    platform's Pallas attention."""
    from hsd_jax.loading.gguf_file import read_gguf
    from hsd_jax.loading.gguf_loader import gguf_config
    from hsd_jax.loading.hf import hf_config, read_json

    overrides = dict(dtype=dtype, attention_impl=PLATFORM_IMPL[platform])
    if model in SHAPES:
        return SHAPES[model].replace(**overrides), model
    path = api.model_path(model)
    if path.endswith(".gguf"):
        return gguf_config(read_gguf(path), path, **overrides), model
    return hf_config(read_json(os.path.join(path, "config.json")), path, **overrides), model


def abstract_target(cfg: ModelConfig, name: str, max_cache_len: int = 2048) -> api.Target:
    """A Target whose params are ShapeDtypeStructs (the loaders' tree: `llama.init_params`'s)."""
    from hsd_jax.models import llama

    params = jax.eval_shape(lambda k: llama.init_params(cfg, k), jax.random.key(0))
    return api.Target(params, cfg, None, max_cache_len, name)


def abstract_drafter(kind: str, target: api.Target):
    """The drafter `generate` would use (the shipped one for this target, else a random one):
    its config and d2t, and its params as ShapeDtypeStructs (traced against the abstract target)."""
    built = {}

    def build(tparams):
        t = dataclasses.replace(target, params=tparams)
        shipped = api.shipped_drafter(kind, t)
        with jax.ensure_compile_time_eval():   # a checkpoint restores concrete arrays, even inside this trace
            d = api.load_drafter(kind, shipped, target=t, random_init=shipped is None and not
                                 methods.REGISTRY[kind].drafter.built_in)
        built["drafter"] = d
        return d.params

    params = jax.eval_shape(build, target.params)
    return dataclasses.replace(built["drafter"], params=params)


def _place(tree, mesh, specs=None):
    """ShapeDtypeStructs of `tree` with NamedShardings on `mesh` (`specs`: a PartitionSpec tree, or
    None for replicated)."""
    specs = jax.tree.map(lambda _: P(), tree) if specs is None else specs
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                        tree, specs, is_leaf=lambda s: isinstance(s, P))


def _batch_spec(x, mesh):
    return sharding.fit_spec(sharding.BATCH_SPEC, x.shape, mesh)


def generate_programs(target: api.Target, method_names: Sequence[str], mesh, *, batch: int, prompt_len: int,
                      sampling: SamplingConfig = SamplingConfig(), platform: str = "tpu") -> list[Program]:
    """The two programs `api.generate` compiles per method (`api.programs`: the same jitted functions
    and static arguments, with the `SpecConfig` `platform`'s defaults give the method and the drafter `generate` would
    use): the prefill of `prompt_len`'s prompt bucket, over abstract prompts [batch, bucket], and the
    decode loop, over the abstract `engine.Prefilled` that prefill returns (`jax.eval_shape`)."""
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    key = _place(jax.eval_shape(lambda: jax.random.key(0)), mesh)
    bound = _place(jax.ShapeDtypeStruct((), jnp.int32), mesh)
    sharding.check_mesh(target.config, mesh, batch, "target")
    programs = []
    for name in method_names:
        spec, drafter = None, None
        if name != "ar":
            spec = engine.SpecConfig(method=name, **engine.spec_defaults(name, platform))
            drafter = abstract_drafter(name, target)
            methods.get(name).check(drafter, spec)
            if isinstance(drafter.config, ModelConfig):   # a draft LM (sd)
                sharding.check_mesh(drafter.config, mesh, batch, "draft model")
        progs = api.programs(target, spec, drafter, sampling, mesh)
        weights = [_place(w, mesh, sharding.param_specs(w, mesh)) for w in progs.weights[:2]]
        weights += [_place(jax.ShapeDtypeStruct(np.shape(w), np.asarray(w).dtype), mesh) for w in progs.weights[2:]]
        bucket = api.prompt_bucket_length(prompt_len, capacity=progs.capacity)
        tokens = jax.ShapeDtypeStruct((batch, bucket), jnp.int32)
        args = (*weights, _place(tokens, mesh, _batch_spec(tokens, mesh)),
                _place(lengths, mesh, _batch_spec(lengths, mesh)), key)
        with jax.set_mesh(mesh):   # as `build` traces it (Pallas reads the chip kind from the mesh)
            prefilled = jax.eval_shape(functools.partial(progs.prefill, **progs.prefill_static), *args)
        programs.append(Program(f"{name}/prefill{bucket}", progs.prefill, args, progs.prefill_static, mesh,
                                kernels_expected=False))   # causal attention over the prompt: no tree kernel
        programs.append(Program(f"{name}/decode", progs.decode, (*weights, _with_shardings(prefilled, mesh), bound),
                                progs.decode_static, mesh))
    return programs


def _with_shardings(tree, mesh):
    """`tree`'s ShapeDtypeStructs placed on `mesh` as the decode loop receives them: KV caches
    [L, B, H, S, D] as `sharding.constrain_cache` pins them, other per-sequence arrays over `data`,
    the rest replicated (`jax.eval_shape` under Auto axes gives no shardings)."""
    batch = tree.prompt_lens.shape[0]

    def spec(x):
        if x.ndim == 5:
            return sharding.fit_spec(sharding.CACHE_SPEC, x.shape, mesh)
        return _batch_spec(x, mesh) if x.ndim and x.shape[0] == batch else P()

    return jax.tree.map(lambda x: _place(jax.ShapeDtypeStruct(x.shape, x.dtype), mesh, spec(x)), tree)


def train_programs(target: api.Target, kinds: Sequence[str], mesh, **options) -> list[Program]:
    """The optimizer step `hsd train` compiles per drafter kind (`trainer.train_task`,
    `trainer.make_optimizer`, `trainer.make_train_step` over `trainer.with_matmul_inputs`) over an abstract batch, for a training config
    with these `options` (TrainConfig fields: batch_size, window, unroll, ...; its defaults otherwise)."""
    from hsd_jax.models.eagle3 import Eagle3Config
    from hsd_jax.train import losses, trainer

    programs = []
    options = dict(dict(draft_vocab_size=min(8192, target.config.vocab_size)), **options)
    for kind in kinds:
        if kind not in TRAIN_KINDS:
            raise InputError(f"--train kinds are {', '.join(TRAIN_KINDS)}, got {kind!r}")
        cfg = trainer.TrainConfig(kind=kind, data_dir="(compile)", out_dir="(compile)", **options)
        if kind == "eagle3" and not cfg.feature_layers:   # as `trainer.train` defaults them
            cfg = dataclasses.replace(cfg, feature_layers=Eagle3Config.default_layers(target.config.num_layers))
        batch, window = cfg.batch_size, cfg.window
        sharding.check_mesh(target.config, mesh, batch, "target")
        vocab = (np.arange(cfg.draft_vocab_size, dtype=np.int32), 1.0)
        built = {}

        def build(tparams, cfg=cfg, vocab=vocab):
            task = trainer.train_task(cfg, dataclasses.replace(target, params=tparams), None, vocab)
            built.update(task)
            return task["params"], task["consts"]

        params, consts = jax.eval_shape(build, target.params)
        tx = trainer.make_optimizer(cfg, params)
        state = {"params": params, "opt": jax.eval_shape(tx.init, params)}
        state = _place(state, mesh, sharding.param_specs(state, mesh))
        consts = _place(consts, mesh, sharding.param_specs(consts, mesh))
        d = 1 if kind == "sd" else target.config.hidden_size
        shapes = [(batch, window), (batch, window, d), (batch, window), (batch, window)]
        dtypes = [jnp.int32, jnp.float32, jnp.bool_, jnp.bool_]
        aux = None
        if cfg.feature_layers:
            aux = jax.ShapeDtypeStruct((batch, window, len(cfg.feature_layers), d), jnp.float32)
        fields = [jax.ShapeDtypeStruct(s, t) for s, t in zip(shapes, dtypes)] + [aux]
        b = losses.Batch(*[None if x is None else _place(x, mesh, _batch_spec(x, mesh)) for x in fields])
        key = _place(jax.eval_shape(lambda: jax.random.key(0)), mesh)
        lr = _place(jax.ShapeDtypeStruct((), jnp.float32), mesh)
        step = trainer.make_train_step(trainer.with_matmul_inputs(built["loss"], cfg.compute_dtype), tx, state)
        programs.append(Program(f"train-{kind}/b{batch}w{window}", step, (state, b, key, lr, consts), {}, mesh,
                                kernels_expected=False))
    return programs


def _count_kernels(text: str, platform: str) -> dict:
    """Custom calls to each kernel target: `custom_call_target="T"` in HLO, `custom_call @T(` in StableHLO."""
    return {name: text.count(f'"{target}"') + text.count(f"@{target}(")
            for name, target in KERNEL_CALLS[platform].items()}


def _memory(compiled, hbm_bytes: int | None) -> dict | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    mem = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp",
                                                                  "generated_code")}
    mem["total"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    if hbm_bytes:
        mem["hbm"] = hbm_bytes
        mem["fits"] = mem["total"] <= hbm_bytes
    return mem


def _cost(compiled) -> dict | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    if not cost:
        return None
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def build(program: Program, platform: str, hbm_bytes: int | None = None) -> Result:
    """Compile (TPU) or lower (CUDA) one program; every failure becomes the result's one-line error."""
    t0 = time.perf_counter()
    res = Result(program.name, False, kernels_expected=program.kernels_expected)
    try:
        if platform == "tpu":
            with jax.set_mesh(program.mesh):   # Pallas's TPU lowering reads the chip kind from this mesh
                compiled = program.fn.lower(*program.args, **program.static).compile()
            res.kernels = _count_kernels(compiled.as_text(), platform)
            res.memory, res.cost = _memory(compiled, hbm_bytes), _cost(compiled)
        else:
            # Triton calls have no serialisation guarantee: allowed here, since nothing is serialised
            unstable = [jax.export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_CALLS["cuda"].values()]
            exported = jax.export.export(program.fn, platforms=("cuda",), disabled_checks=unstable)(
                *program.args, **program.static)
            res.kernels = _count_kernels(exported.mlir_module(), platform)
        res.ok = not program.kernels_expected or sum(res.kernels.values()) > 0
        if not res.ok:
            res.error = "built, but without the Pallas tree-attention kernel (attention fell back to XLA)"
    except Exception as e:   # the report names it; the caller's exit status says that something failed
        res.error = one_line(e)
    res.seconds = round(time.perf_counter() - t0, 2)
    return res


def _strip_shardings(tree):
    return jax.tree.map(lambda x: x if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compile_all(*, tpu: str | None = None, cuda: bool = False, model: str = "smollm2-135m",
                method_names: Sequence[str] = methods.METHODS, dtype: str = "bfloat16", batch: int = 1,
                mesh: tuple[int, int] = (1, 1), train: Sequence[str] = (), prompt_len: int = 64,
                max_cache_len: int = 2048, temperature: float = 0.0, config: ModelConfig | None = None,
                train_options: dict | None = None, log: Callable[[Result], None] | None = None) -> dict:
    """Build every program for one platform; returns a JSON-ready report whose "ok" is True only if
    all of them built. `config` (a ModelConfig) replaces `model` (tests, shapes without files);
    `train_options`: TrainConfig fields for the training steps (default: `hsd train`'s defaults)."""
    if (tpu is None) == (not cuda):
        raise CompileSetupError("give one platform: --tpu TOPOLOGY or --cuda")
    unknown = [m for m in method_names if m not in methods.METHODS]
    if unknown:
        raise InputError(f"unknown methods {unknown}: choose from {', '.join(methods.METHODS)}")
    if batch < 1 or prompt_len < 1 or max_cache_len < 1:
        raise InputError("batch, prompt length and max_cache_len must be >= 1")
    platform = "tpu" if tpu else "cuda"
    if config is None:
        cfg, name = model_config(model, dtype, platform)
    else:
        cfg, name = config.replace(dtype=dtype, attention_impl=PLATFORM_IMPL[platform]), "config"
    data, model_axis = mesh
    hbm = None
    if platform == "tpu":
        devices = tpu_devices(tpu)
        if data * model_axis > len(devices):
            raise CompileSetupError(f"mesh {data}x{model_axis} needs {data * model_axis} devices; {tpu} has "
                                    f"{len(devices)}")
        kind = devices[0].device_kind
    else:
        if (data, model_axis) != (1, 1):
            raise CompileSetupError("--mesh is for --tpu (the CUDA programs are lowered for one GPU)")
        devices, kind = jax.devices()[:1], "cuda"
    dev_mesh = sharding.make_mesh(data, model_axis, devices=devices)
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        with jax.set_mesh(dev_mesh):   # per TensorCore; a device spans num_cores of them (megacore)
            info = pltpu.get_tpu_info()
            hbm = info.hbm_capacity_bytes * info.num_cores
    target = abstract_target(cfg, name, max_cache_len)
    sampling = SamplingConfig(float(temperature))
    programs = generate_programs(target, list(method_names), dev_mesh, batch=batch, prompt_len=prompt_len, platform=platform,
                                 sampling=sampling)
    programs += train_programs(target, train, dev_mesh, **(train_options or {}))
    if platform == "cuda":   # lowered for one GPU: no device shardings in the arguments
        programs = [dataclasses.replace(p, args=_strip_shardings(p.args), mesh=None) for p in programs]
    results = []
    for p in programs:   # name/dtype/batch[/mesh]; training steps carry their own batch and window
        p.name = f"{p.name}/{'bf16' if dtype == 'bfloat16' else 'f32'}" + ("" if p.name.startswith("train-") else f"/b{batch}") + (
            f"/mesh{data}x{model_axis}" if (data, model_axis) != (1, 1) else "")
        results.append(build(p, platform, hbm))
        if log is not None:
            log(results[-1])
    return {"platform": platform, "topology": tpu, "device_kind": kind, "model": name, "dtype": dtype,
            "batch": batch, "mesh": f"{data}x{model_axis}", "ok": all(r.ok for r in results),
            "programs": [dataclasses.asdict(r) for r in results]}


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def format_result(r: Result) -> str:
    """One line per program for the terminal."""
    head = f"{'ok  ' if r.ok else 'FAIL'} {r.name:<28} {r.seconds:6.1f} s"
    if not r.ok:
        return f"{head}  {r.error}"
    parts = [" ".join(f"{k}={v}" for k, v in r.kernels.items())]
    if r.memory:
        m = r.memory
        fit = "" if "hbm" not in m else (f" of {m['hbm'] / 2 ** 30:.0f} GiB HBM "
                                         f"({'fits' if m['fits'] else 'DOES NOT FIT'})")
        parts.append(f"args {_mib(m['argument'])} out {_mib(m['output'])} temp {_mib(m['temp'])}{fit}")
    if r.cost:
        parts.append(f"flops {r.cost['flops']:.3g} bytes {r.cost['bytes_accessed']:.3g}")
    return f"{head}  " + "  ".join(parts)
