"""The dequantized weights of a GGUF file, kept on disk after the first load so later loads read
them back instead of decoding the quantized blocks again (SmolLM2's Q4_1 file: seconds of numpy).

One safetensors file per source file, in `<user cache>/weights/` (`$HSD_JAX_CACHE`, default
`~/.cache/hsd_jax`), holding the float32 param tree (flattened names, e.g. `layers/mlp/up_proj/kernel`).
Its name is a fingerprint of the source (size, modification time and the SHA-256 of sampled
blocks: a fast hash that changes when the file is replaced or edited), and its header records
that fingerprint and a checksum of every tensor's bytes (a wrapping 64-bit sum: the whole file in
tens of milliseconds). A file whose header, fingerprint, names, shapes or checksum disagree is
stale or corrupt: it is deleted and rebuilt from the source. `HSD_JAX_WEIGHTS_CACHE=0` turns the
cache off. Read with `safetensors` (no pickle); written to a temporary file then renamed, so a
concurrent reader never sees half a file.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import warnings

import numpy as np

ENV = "HSD_JAX_WEIGHTS_CACHE"
FORMAT = "1"            # bump when the cached layout changes
SAMPLE_BYTES = 1 << 20  # per sampled block of the source file
SAMPLES = 8


def disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def fingerprint(path: str) -> str:
    """A fast hash of a file: its size, mtime and SAMPLES blocks spread over it."""
    st = os.stat(path)
    h = hashlib.sha256(f"{FORMAT}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek(max(0, (st.st_size - SAMPLE_BYTES) * i // max(SAMPLES - 1, 1)))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]


def cache_file(path: str) -> str:
    from hsd_jax.tuning import cache_dir

    name = os.path.basename(path).replace(".", "_")
    return os.path.join(os.path.dirname(cache_dir()), "weights", f"{name}-{fingerprint(path)}.safetensors")


def checksum(arrays: dict) -> str:
    """A wrapping 64-bit sum of every tensor's bytes, weighted by its place in name order."""
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for i, name in enumerate(sorted(arrays)):
            raw = np.ascontiguousarray(arrays[name]).reshape(-1).view(np.uint8)
            whole = len(raw) // 8 * 8
            s = raw[:whole].view("<u8").sum(dtype=np.uint64) + raw[whole:].sum(dtype=np.uint64)
            total = total + s * np.uint64(2 * i + 1)
    return f"{int(total):016x}"


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, v in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def load(path: str, expected: dict) -> dict | None:
    """The cached param tree of `path` if a valid one exists (names and shapes as `expected`:
    flat name -> shape), else None (a stale or corrupt file is removed)."""
    if disabled():
        return None
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    try:
        target = cache_file(path)
    except OSError:
        return None
    if not os.path.isfile(target):
        return None
    try:
        with safe_open(target, "np") as f:
            meta = f.metadata() or {}
        flat = load_file(target)
        ok = (meta.get("source") == os.path.basename(target).rsplit("-", 1)[-1].removesuffix(".safetensors")
              and {k: tuple(v.shape) for k, v in flat.items()} == {k: tuple(s) for k, s in expected.items()}
              and all(v.dtype == np.float32 for v in flat.values())
              and meta.get("checksum") == checksum(flat))
    except (SafetensorError, OSError, ValueError, KeyError):
        ok = False
    if ok:
        return unflatten(flat)
    warnings.warn(f"rebuilding the weights cache {target}: it was stale or corrupt", stacklevel=2)
    try:
        os.remove(target)
    except OSError:
        pass
    return None


def store(path: str, params: dict) -> None:
    """Write the float32 param tree of `path` to the cache (best effort: a full disk only warns)."""
    if disabled():
        return
    from safetensors.numpy import save_file

    flat = {k: np.ascontiguousarray(v, np.float32) for k, v in flatten(params).items()}
    try:
        target = cache_file(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        meta = {"source": os.path.basename(target).rsplit("-", 1)[-1].removesuffix(".safetensors"),
                "checksum": checksum(flat), "format": FORMAT}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
        os.close(fd)
        try:
            save_file(flat, tmp, metadata=meta)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError as e:
        warnings.warn(f"could not write the weights cache: {e}", stacklevel=2)
