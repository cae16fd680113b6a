"""CPU kernels for the target at decode and verify sizes (1-64 rows): layer matmuls, tree attention
and the LM head's bf16 screen; the feature drafters' layer and draft head run them too.

Inside the layer `lax.scan`, XLA:CPU copies each layer's weight matrices out of the stacked
[L, d, f] arrays before its GEMM whenever a forward has 2+ rows: as much time as the products
(BENCHMARKS.md, "Why the CPU kernels"). `stacked_matmul.cc` is an XLA FFI handler that reads a layer's
weights in place from a pre-packed copy ([L, f / 32, d, 32]: every 32-column tile contiguous,
streamed in order), each weight once for all rows. The engine uses it for every Dense of the
target's layers when `enabled()`: on the CPU, no mesh, a forward of at most MAX_ROWS rows, a causal one
(a prefill) of at most MAX_PREFILL_ROWS (f32; bf16: any, below); training keeps XLA's dots.

A bf16 target (`load_target(..., dtype="bfloat16")`) runs the same kernels on its bf16 weights,
packed as they are (half the bytes of f32; the attention kernel reads a bf16 cache too): each bf16
value is widened to f32 exactly in registers, activations (bf16 values) go in as f32 exactly, products and
sums are f32, and each Dense's output is rounded to bf16 as XLA's bf16 dot rounds it. So the
outputs are the bf16 model's (XLA's bf16 path up to f32 summation order), not the f32 model's. A
decode or verify row is computed alike at any row count, so every forward of a bf16 model runs here,
prefill too (any rows; its Dense layers from DOT_MIN_ROWS rows on AVX-512 BF16 dot products, the
bf16 products exact, summed in pairs: 0.80-0.88x the prefill's time at 128-2048 prompt tokens), its
norms' sums of squares too (`rms_norm`), its programs compile without excess precision
(`api.BF16_EXACT_OPTIONS`), and every method's greedy output equals bf16 `ar`'s. Its LM head runs the
kernel too (`packed_kernels["head"]`, `llama.serving_logits`); its KV cache is f32
(`llama.cache_dtype`: exact for bf16 K/V).

`tree_attention.cc` likewise reads a layer's K/V from the stacked cache in place, and only the
slots a query sees (the committed prefix and its ancestors among the new tokens), where XLA
copies the layer's cache out of the stack and scores every slot up to the capacity. The matmul
handler also takes bf16 weights (widened exactly in registers): the greedy head's certified
screen (`llama.screened_argmax`) streams a packed bf16 copy of the embedding with it, in bf16 pairs
(AMX tiles where the CPU and Linux allow, else AVX-512 BF16 dot products, else FMAs).

Built on first use with the system C++ compiler against the running jaxlib's FFI headers (so
the binary always matches the installed jaxlib and this CPU), cached in the user cache folder
(`hsd_jax.kernel_build`); `prebuild()` (called by `api.load_target`; the CLI starts the build
before importing JAX) runs it in the background, so a first process's compiler overlaps its
imports, model load, packing and the programs' tracing and lowering (`expected`). No compiler, a failed build or `HSD_CPU_KERNELS=0`: XLA's dots, with one
warning. A load with a mesh and a multi-process run build none (neither uses them).
"""
from __future__ import annotations

import ctypes
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax import kernel_build

COLS = 32           # the kernel's column tile (the packed layout's last axis)
MAX_ROWS = 64       # forwards up to this many rows (batch x new tokens): measured faster than XLA up to 64
# causal forwards (prefills) up to this many rows: 0.59-0.78x XLA's time at 69-2000 prompt tokens (Zen 4); the
# attention kernel's [B, T, T] visibility mask bounds it (16 MB at 2048)
MAX_PREFILL_ROWS = 2048
# a bf16 prefill's Dense layers take AVX-512 BF16 dot products from this many (active) rows: stacked_matmul.cc's
# kDotMinRows, which decides (fewer rows: the widening kernel)
DOT_MIN_ROWS = 24
TARGETS = {"hsd_stacked_matmul_packed": "StackedMatmulPacked", "hsd_stacked_matmul_packed_bf16": "StackedMatmulPackedBF16",
           "hsd_stacked_matmul_pairs_bf16": "StackedMatmulPairsBF16",
           "hsd_stacked_matmul_packed_dot_bf16": "StackedMatmulPackedDotBF16",
           "hsd_tree_attention": "TreeAttention", "hsd_tree_attention_bf16": "TreeAttentionBF16"}
DTYPES = (jnp.float32, jnp.bfloat16)   # the weight and cache dtypes the kernels read


def wanted() -> bool:
    """Whether this process would serve on the kernels once built: CPU backend, one process (a
    multi-process run shards every program over a mesh, which the kernels do not serve, and its other
    processes write no file), not disabled."""
    return not kernel_build.disabled() and jax.default_backend() == "cpu" and jax.process_count() == 1


def prebuild() -> None:
    """Start building the kernel library in the background if this process will want it and the
    cache lacks it, so the compiler runs while the model loads; `enabled()` waits for it. A failure
    is reported there (never here)."""
    if wanted():
        kernel_build.start()


def wait_for_build() -> None:
    """Let a build `prebuild` (or the CLI's start) began finish, whether or not anything used it."""
    kernel_build.wait()


@functools.cache
def _registered() -> bool:
    """Build (once per machine; or wait for `prebuild`'s build) and register the kernel; False,
    with a warning, when that fails."""
    try:
        build = kernel_build.pending()
        if build is not None:
            build.result()
        lib = ctypes.cdll.LoadLibrary(kernel_build.library_path())
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return True
    except Exception as e:  # noqa: BLE001 - any failure means XLA's dots, never a crash
        warnings.warn(f"hsd_jax CPU kernel unavailable, using XLA's dots: {e}", RuntimeWarning, stacklevel=3)
        return False


def enabled() -> bool:
    """Whether serving on this process may use the kernel: CPU backend, one process, not disabled, built."""
    return wanted() and _registered()


class Unavailable(RuntimeError):
    """A program was traced for the kernels while their build ran (`expected`), and the build failed."""


def expected() -> bool:
    """`enabled()` without waiting for a build in progress (then True: programs are traced and lowered
    for the kernels while the compiler runs, and only XLA's compile waits for it, `api.compiled`,
    which raises `Unavailable` if the build failed; the caller then traces again without them)."""
    return wanted() and (building() or _registered())


def building() -> bool:
    """Whether this process's build of the kernel library is still running."""
    try:
        build = kernel_build.pending()
    except Exception:  # noqa: BLE001 - e.g. an unreadable source: `enabled` reports it
        return False
    return build is not None and not build.done()


# bf16 tiles store columns 0, 16, 1, 17, ..., 15, 31: the kernel widens each 32-bit pair with a shift and a mask
BF16_ORDER = np.stack([np.arange(COLS // 2), np.arange(COLS // 2) + COLS // 2], 1).reshape(-1)


def on_cpu(a: np.ndarray) -> jax.Array:
    """A host array as a JAX array on the CPU device: `jax.device_put`, which compiles nothing
    (`jnp.asarray` compiles a copy program for every new shape and dtype: ~20 of them, ~0.5 s, in a
    first `generate` that packs a target and a drafter)."""
    return jax.device_put(a, jax.devices("cpu")[0])


def pack(w, dtype=np.float32, into: np.ndarray | None = None) -> np.ndarray:
    """[L, d, f] -> [L, f / 32, d, 32] in `dtype`, each column tile contiguous (bf16: its columns in
    BF16_ORDER); written into `into` (of that shape and dtype) where given."""
    w = np.asarray(w, np.float32)
    L, d, f = w.shape
    tiles = w.reshape(L, d, f // COLS, COLS).transpose(0, 2, 1, 3)
    if np.dtype(dtype) == jnp.bfloat16:
        tiles = tiles[..., BF16_ORDER]
    if into is not None:
        into[...] = tiles
        return into
    return np.ascontiguousarray(tiles, dtype=dtype)   # one pass (astype keeps the transposed strides: two)


def pack_pairs(w, into: np.ndarray | None = None) -> np.ndarray:
    """[L, d, f] -> bf16 [L, f / 32, ceil(d / 2), 64]: each 32-column tile's rows in pairs along d, as
    AVX-512 BF16 dot products read them (row p: columns 0-15, then 16-31, each as the bf16 pair
    (w[2p, c], w[2p + 1, c]); an odd d padded with a zero row). For inputs that are bf16 values:
    `stacked_matmul` rounds them to bf16. Written into `into` where given."""
    w = np.asarray(w, np.float32)
    L, d, f = w.shape
    if d % 2:
        w = np.pad(w, ((0, 0), (0, 1), (0, 0)))
    dp = w.shape[1] // 2
    tiles = w.reshape(L, dp, 2, f // COLS, 2, COLS // 2).transpose(0, 3, 1, 4, 5, 2)   # [L, t, p, half, c, k]
    out = np.empty((L, f // COLS, dp, 2 * COLS), jnp.bfloat16) if into is None else into
    out.reshape(L, f // COLS, dp, 2, COLS // 2, 2)[...] = tiles   # rounded as written: no f32 copy first
    return out


def bf16_dot_products() -> bool:
    """Whether the built kernel has AVX-512 BF16 dot products (the pairs layout's fast path; without
    them it widens the pairs and sums with FMAs: same results up to f32 summation order)."""
    return enabled() and bool(ctypes.cdll.LoadLibrary(kernel_build.library_path()).HsdBF16DotProducts())


def amx_tiles() -> bool:
    """Whether the pairs layout (the f32 head's screen) runs on AMX tile dot products here: built for a
    CPU with AMX-BF16 and Linux granted this process the tile state (else AVX-512 BF16 or FMAs; the same
    bf16 products, summed in f32 in another order)."""
    return enabled() and bool(ctypes.cdll.LoadLibrary(kernel_build.library_path()).HsdAmxTiles())


def pack_head(weight, dtype, into: np.ndarray | None = None) -> np.ndarray:
    """An LM head [d, V] as [1, ceil(V / 32), d, 32] in `dtype`, the vocabulary zero-padded to
    whole column tiles (`stacked_matmul`'s output then has V rounded up to 32 columns)."""
    w = np.asarray(weight, np.float32)
    return pack((np.pad(w, ((0, 0), (0, -w.shape[1] % COLS))) if w.shape[1] % COLS else w)[None], dtype, into)


def pack_head_screen(embedding, into: np.ndarray | None = None) -> np.ndarray:
    """The bf16 screen of a tied f32 LM head (`llama.screened_argmax`) from the embedding [V, d], in
    pairs (`pack_pairs`; its inputs are bf16 values), the vocabulary zero-padded to whole column tiles."""
    e = np.asarray(embedding, np.float32)
    return pack_pairs((np.pad(e.T, ((0, 0), (0, -e.shape[0] % COLS))) if e.shape[0] % COLS else e.T)[None], into)


def head_screen_norms(embedding, into: np.ndarray | None = None) -> np.ndarray:
    """[2, V] f32: ||bf16(E_v)|| and ||E_v - bf16(E_v)|| of each embedding row, the norms that bound the
    bf16 screen's error (`llama.HeadScreen`), summed in f64; packed once with the screen, so a
    `generate` call does not pass over the embedding for them (~65 ms a call on a 2-core Xeon VM)."""
    e = np.asarray(embedding, np.float32)
    out = np.empty((2, e.shape[0]), np.float32) if into is None else into
    for lo in range(0, e.shape[0], 4096):      # in slices: no [V, d] f64 copy
        rows = e[lo:lo + 4096].astype(np.float64)
        eb = np.asarray(e[lo:lo + 4096].astype(jnp.bfloat16), np.float64)
        out[0, lo:lo + 4096] = np.sqrt(np.sum(eb * eb, -1))
        out[1, lo:lo + 4096] = np.sqrt(np.sum(np.square(rows - eb), -1))
    return out


def head_layout(d: int, vocab: int, dtype) -> tuple:
    """(shape, dtype) of `pack_head` (bf16 `dtype`: [1, V / 32, d, 32]) or, f32, of `pack_head_screen`."""
    tiles = -(-vocab // COLS)
    if np.dtype(dtype) == jnp.bfloat16:
        return (1, tiles, d, COLS), np.dtype(jnp.bfloat16)
    return (1, tiles, (d + 1) // 2, 2 * COLS), np.dtype(jnp.bfloat16)


def layers_layout(layers: dict, dtype=None) -> dict:
    """{name: (shape, dtype)} of what `pack_layers(layers, dtype)` returns."""
    return {name: ((L, f // COLS, d, COLS), np.dtype(dtype or w.dtype)) for name, w in _packable(layers).items()
            for L, d, f in [w.shape]}


def _packable(layers: dict) -> dict:
    """{"q_proj": kernel, "mlp/gate_proj": ...}: the stacked Dense kernels the matmul kernel serves."""
    out = {}

    def visit(tree, path):
        for name, sub in tree.items():
            if (name == "kernel" and getattr(sub, "ndim", 0) == 3 and sub.dtype in DTYPES
                    and sub.shape[2] % COLS == 0):
                out["/".join(path)] = sub
            elif isinstance(sub, dict):
                visit(sub, path + (name,))

    visit(layers, ())
    return out


def pack_layers(layers: dict, dtype=None, into: dict | None = None) -> dict:
    """{"q_proj": [L, f/32, d, 32], "mlp/gate_proj": ...}: every f32 or bf16 Dense kernel of the
    stacked layer params whose output width is a multiple of COLS, packed in its own dtype or in
    `dtype` (the others keep XLA's dot), as CPU JAX arrays; or written into `into`'s host arrays
    (`layers_layout`), which it returns."""
    if into is not None:
        return {name: pack(w, dtype or w.dtype, into[name]) for name, w in _packable(layers).items()}
    return {name: on_cpu(pack(w, dtype or w.dtype)) for name, w in _packable(layers).items()}


def stacked_matmul(x, packed, layer, active=None, dot_products: bool = False):
    """x [N, d] @ the layer's [d, f] weights from their packed stack [L, f / 32, d, 32] (f32 or
    bf16 weights; f32 products and sums either way) or [L, f / 32, ceil(d / 2), 64] (`pack_pairs`:
    x rounded to bf16). `active` [N] bool: only those rows are computed, the others come out 0
    (default: all)."""
    f = packed.shape[1] * COLS
    if packed.shape[-1] == 2 * COLS:
        target = "hsd_stacked_matmul_pairs_bf16"
    else:
        target = "hsd_stacked_matmul_packed_bf16" if packed.dtype == jnp.bfloat16 else "hsd_stacked_matmul_packed"
        if dot_products and packed.dtype == jnp.bfloat16:
            target = "hsd_stacked_matmul_packed_dot_bf16"
    active = jnp.ones((x.shape[0],), jnp.int32) if active is None else jnp.asarray(active).astype(jnp.int32)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], f), jnp.float32))(
        x.astype(jnp.float32), packed, jnp.asarray(layer, jnp.int32).reshape(1), active)


def rms_norm(x, scale, eps: float):
    """`layers.rms_norm` with its sum of squares on `stacked_matmul` (x^2 against a column of ones):
    the same bits for a row at any row count. XLA:CPU's reduction can sum a row in another order when
    a forward has 8+ rows, and a bf16 model rounds that f32 difference to a bf16 ulp (a verify row then
    differed from the decode step, SmolLM2 layer 27). For bf16 models on the kernels."""
    d = x.shape[-1]
    xf = x.astype(jnp.float32).reshape(-1, d)
    ones = np.zeros((1, 1, d, COLS), np.float32)
    ones[..., 0] = 1.0   # one column: not a splat, so XLA keeps a literal (a splat it broadcast every layer call)
    ss = stacked_matmul(xf * xf, ones, 0)[:, :1]
    y = xf * jax.lax.rsqrt(ss / d + eps) * scale.astype(jnp.float32)
    return y.reshape(x.shape).astype(x.dtype)


def dense_interceptor(packed: dict, layer, active=None, dot_products: bool = False):
    """A Flax method interceptor: each Dense whose path (inside the decoder layer) has a packed
    kernel runs `stacked_matmul` on layer `layer` instead of its own (sliced) kernel, on the
    `active` rows ([B, T] bool; default all) only, bf16 weights with `dot_products` where given (a
    prefill's); a bf16 RMSNorm runs `rms_norm`."""
    from hsd_jax.models.layers import RMSNorm

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, RMSNorm) and context.method_name == "__call__" and module.dtype == jnp.bfloat16:
            return rms_norm(args[0], module.variables["params"]["scale"], module.eps)
        key = "/".join(module.scope.path) if isinstance(module, nn.Dense) else None
        if context.method_name != "__call__" or key not in packed:
            return next_fun(*args, **kwargs)
        x = args[0]
        rows = None if active is None else active.reshape(-1)
        dots = dot_products and x.dtype == jnp.bfloat16     # bf16 values in: the pairs hold them exactly
        y = stacked_matmul(x.reshape(-1, x.shape[-1]), packed[key], layer, rows, dots).reshape(*x.shape[:-1], -1)
        y = y.astype(module.dtype or x.dtype)      # rounded as the Dense's own dot rounds (bf16 models)
        if module.use_bias:
            y = y + module.variables["params"]["bias"]
        return y

    return intercept


def attention_supported(cache_dtype, head_dim: int) -> bool:
    """Whether `tree_attention` serves a cache of this dtype and head size (f32 or bf16; Dh a
    multiple of 16 up to 128)."""
    return jnp.dtype(cache_dtype) in DTYPES and head_dim % 16 == 0 and head_dim <= 128


def tree_attention(q, k_stack, v_stack, layer, lengths, ancestors, scale: float, token_major: bool = False):
    """Attention of q [B, Hq, N, Dh] ([B, N, Hq, Dh] with `token_major`, as the projections make it:
    no transposes around the call, 0.2 ms of a 20 ms verify round at 8 rows) over layer `layer` of
    the stacked cache [L, B, Hkv, S, Dh] (the N new tokens' K/V already written at slots
    lengths[b] + i): query i sees the prefix [0, lengths[b]) and new token a where ancestors[b, i, a]
    (`tree_attention_reference`'s rule); a query that is not its own ancestor is skipped and outputs
    0. An f32 or bf16 cache (read as stored, widened exactly); f32 output in q's layout either way."""
    target = "hsd_tree_attention_bf16" if k_stack.dtype == jnp.bfloat16 else "hsd_tree_attention"
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_stack, v_stack, jnp.asarray(layer, jnp.int32).reshape(1),
        lengths.astype(jnp.int32), ancestors.astype(jnp.int32), scale=np.float32(scale),
        token_major=np.int32(token_major))
