"""The dequantized weights of a GGUF file, kept on disk after the first load so later loads read
them back instead of decoding the quantized blocks again (SmolLM2's Q4_1 file: seconds of numpy).

One safetensors file per source file, in `<user cache>/weights/` (`$HSD_JAX_CACHE`, default
`~/.cache/hsd_jax`), holding the float32 param tree (flattened names, e.g. `layers/mlp/up_proj/kernel`).
Its name is a fingerprint of the source (size, modification time and the SHA-256 of sampled
blocks: a fast hash that changes when the file is replaced or edited), and its header records
that fingerprint and a checksum of every tensor's bytes (a wrapping 64-bit sum: the whole file in
tens of milliseconds). A file whose header, fingerprint, names, shapes or checksum disagree is
stale or corrupt: it is deleted and rebuilt from the source. Arrays derived from those weights
(the CPU kernels' packed copies: `api.serving_params`) are kept beside them under the same rules,
in files named by the same fingerprint and a variant naming what else they depend on; so are the
arrays of a drafter's Orbax checkpoint (`api.load_drafter`: a folder, fingerprinted file by file),
read back without importing Orbax.
Storing a file's weights removes the cache files of older versions of a file of that name (a
reinstalled model: another fingerprint). `HSD_JAX_WEIGHTS_CACHE=0` turns the cache off. Read with `safetensors` (no pickle); written to a
temporary file then renamed, so a concurrent reader never sees half a file. An f32 GGUF load on
the CPU decodes its weights, and packs them for the CPU kernels, straight into such a temporary
file's mapping (`create`, `InPlace`) and then serves the renamed file's pages: no second copy of
~0.5 GB each to write out (on a VM whose host backs fresh pages lazily, that copy cost a first
process seconds). Other writes (`store`, `store_derived`) run in a low-priority background thread;
every read in the process waits for them first, and so does `wait_for_writes()`, which the CLI calls
before it ends the process. A process serves mapped pages: damage written into a cache file in
place (the cache itself never does) reaches the processes that map it.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import tempfile
import threading
import warnings

import numpy as np

ENV = "HSD_JAX_WEIGHTS_CACHE"
FORMAT = "1"            # bump when the cached layout changes
SAMPLE_BYTES = 1 << 20  # per sampled block of the source file
SAMPLES = 8
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                      "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
                      "U8": np.uint8, "BOOL": np.bool_}


_WRITES: list[threading.Thread] = []   # background writes not yet joined (`wait_for_writes`)


def _in_background(fn, *args) -> None:
    """Run a cache write in a thread of its own (not a daemon: an interpreter's normal exit joins it),
    at the lowest CPU priority: it takes the cores the first process's model load, kernel build and
    compile leave idle instead of slowing them (on 2 cores a write beside them cost the load seconds)."""
    def idle():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)   # Linux: this thread alone
        except (AttributeError, OSError):
            pass
        fn(*args)

    thread = threading.Thread(target=idle, name="hsd-weights-cache-write")
    thread.start()
    _WRITES.append(thread)


def wait_for_writes() -> None:
    """Return once every cache write this process started has finished (before reading the cache,
    and before a process ends without its interpreter's teardown, `os._exit`)."""
    while _WRITES:
        _WRITES.pop(0).join()


def disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def fingerprint(path: str) -> str:
    """A fast hash of a file: its size, mtime and SAMPLES blocks spread over it; of a folder (an
    Orbax checkpoint): that of every file in it, with their relative paths."""
    h = hashlib.sha256(FORMAT.encode())
    if os.path.isdir(path):
        for folder, dirs, files in sorted(os.walk(path)):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(folder, name)
                h.update(f":{os.path.relpath(full, path)}".encode())
                _digest(h, full)
    else:
        _digest(h, path)
    return h.hexdigest()[:32]


def _digest(h, path: str) -> None:
    st = os.stat(path)
    h.update(f":{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek(max(0, (st.st_size - SAMPLE_BYTES) * i // max(SAMPLES - 1, 1)))
            h.update(f.read(SAMPLE_BYTES))


def cache_file(path: str, variant: str = "", source: str | None = None) -> str:
    """The cache file of `path`'s float32 params, or (a `variant`) of other arrays derived from them;
    `source`: `fingerprint(path)` where the caller has it already (it reads the file's samples)."""
    from hsd_jax.tuning import cache_dir

    name = os.path.basename(path).replace(".", "_")
    return os.path.join(os.path.dirname(cache_dir()), "weights",
                        f"{name}-{source or fingerprint(path)}{'-' + variant if variant else ''}.safetensors")


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


def load(path: str, expected: dict, mapped: bool = False) -> dict | None:
    """The cached param tree of `path` if a valid one exists (names and shapes as `expected`:
    flat name -> shape), else None (a stale or corrupt file is removed): numpy arrays read into
    memory, or (`mapped`) CPU JAX arrays over the file's mapped pages (`load_derived`'s: no copy)."""
    flat = _read(path, "", lambda flat: (
        {k: tuple(v.shape) for k, v in flat.items()} == {k: tuple(s) for k, s in expected.items()}
        and all(v.dtype == np.float32 for v in flat.values())), mapped=mapped)
    if flat is None:
        return None
    return unflatten({k: _shared(v) for k, v in flat.items()} if mapped else flat)


def store(path: str, params: dict) -> None:
    """Write the float32 param tree of `path` to the cache (best effort: a full disk only warns), and
    remove the files of older versions of a file of that name (another fingerprint: a reinstalled
    or edited model file), derived ones too, so reinstalls do not pile up gigabytes. In the background:
    `params` must not change afterwards; arrays that view a mapped file (a GGUF's unquantized tensors)
    are copied first, since that file may change or shrink while the write runs (a read of a page
    past its end is a SIGBUS, not an exception)."""
    flat = {k: _detached(np.ascontiguousarray(v, np.float32)) for k, v in flatten(params).items()}
    source = _source(path)

    def write():
        fresh = _write(path, "", flat, source)
        if fresh is not None:
            _evict_older(path, fresh)

    _in_background(write)


def _source(path: str) -> str | None:
    """`path`'s fingerprint now (a write in the background files its arrays under the source they
    came from, not under what the file has become by then), None if it cannot be read."""
    try:
        return None if disabled() else fingerprint(path)
    except OSError:
        return None


def _detached(a: np.ndarray) -> np.ndarray:
    """`a`, or a copy of it where its memory belongs to a mapped file."""
    base = a
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return a.copy()
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else getattr(base, "obj", None)
    return a


def _evict_older(path: str, fresh: str) -> None:
    """Remove the cache files of `path`'s name under any fingerprint but `fresh`."""
    try:
        folder = os.path.dirname(cache_file(path, source=fresh))
        name = re.escape(os.path.basename(path).replace(".", "_"))
        older = re.compile(rf"{name}-(?!{fresh})[0-9a-f]{{32}}(-[^/]*)?\.safetensors")
        for entry in os.listdir(folder):
            if older.fullmatch(entry):
                os.remove(os.path.join(folder, entry))
    except OSError:
        pass


def load_derived(path: str, variant: str) -> dict | None:
    """Flat arrays derived from `path`'s weights and stored by `store_derived` under `variant` (a name
    that changes with whatever else they depend on: e.g. the CPU kernels' packed copies, keyed by the
    params' dtype and the packing code), if a valid file exists, as JAX arrays on the CPU that share
    the file's mapped pages (DLPack: no copy); else None."""
    flat = _read(path, variant, lambda flat: True, mapped=True)
    return None if flat is None else {k: _shared(v) for k, v in flat.items()}


def load_host(path: str, variant: str) -> dict | None:
    """Flat arrays stored by `store_derived` under `variant`, read into host memory (numpy, their
    dtypes restored), if a valid file exists; else None."""
    return _read(path, variant, lambda flat: True)


def _shared(a: np.ndarray):
    """A CPU JAX array over `a`'s memory (a copy where DLPack cannot share it)."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    try:
        if a.dtype.kind in "fiub":
            return jnp.from_dlpack(a, device=cpu)
    except (BufferError, TypeError, ValueError):
        pass
    return jax.device_put(a, cpu)   # e.g. bfloat16, which DLPack lacks (a bitcast compiles a program per shape)


def _mapped(target: str) -> tuple[dict, dict]:
    """(header metadata, name -> array) of a safetensors file mapped copy-on-write: its pages come
    from the page cache as they are read, never copied (safetensors checks the header first: JSON,
    offsets, the file covered exactly). The cache never rewrites a file in place (`_write` renames
    a new one over it), so a mapping stays whole while the cache is rebuilt."""
    from safetensors import safe_open

    with safe_open(target, "np") as f:
        meta = f.metadata() or {}
    mm = np.memmap(target, mode="c")
    n = int(mm[:8].view("<u8")[0])
    flat = {}
    for name, info in json.loads(bytes(mm[8:8 + n])).items():
        if name != "__metadata__":
            start, end = info["data_offsets"]
            flat[name] = mm[8 + n + start:8 + n + end].view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return meta, flat


def store_derived(path: str, variant: str, arrays: dict) -> None:
    """Write flat arrays of any dtype (bfloat16 included) derived from `path`'s weights (in the
    background: `arrays` must not change afterwards; those that view a mapped file are copied)."""
    _in_background(_write, path, variant, {k: _detached(np.ascontiguousarray(v)) for k, v in arrays.items()},
                   _source(path))


def _read(path: str, variant: str, fits, mapped: bool = False) -> dict | None:
    """The verified flat arrays of a cache file (source fingerprint, variant, checksum, `fits(flat)`),
    their dtypes restored, read into memory or (`mapped`) memory-mapped; None if there is none; a
    stale or corrupt one is removed, with a warning."""
    if disabled():
        return None
    wait_for_writes()
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    try:
        source = fingerprint(path)
        target = cache_file(path, variant, source)
    except OSError:
        return None
    if not os.path.isfile(target):
        return None
    try:
        if mapped:
            meta, flat = _mapped(target)
        else:
            with safe_open(target, "np") as f:
                meta = f.metadata() or {}
            flat = load_file(target)
        dtypes = json.loads(meta.get("dtypes", "{}"))
        ok = (meta.get("source") == source and meta.get("variant", "") == variant
              and meta.get("checksum") == checksum(flat) and isinstance(dtypes, dict))
        if ok:
            flat = {k: v.view(_dtype(dtypes[k])) if k in dtypes else v for k, v in flat.items()}
            ok = fits(flat)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError):
        ok = False
    if ok:
        return flat
    warnings.warn(f"rebuilding the weights cache {target}: it was stale or corrupt", stacklevel=3)
    try:
        os.remove(target)
    except OSError:
        pass
    return None


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


SAFETENSORS_NAMES = {np.dtype(v).str: k for k, v in SAFETENSORS_DTYPES.items()}


def _header(layout: dict, metadata: dict) -> tuple[bytes, dict]:
    """A safetensors header (padded to 8 bytes) for arrays of `layout` (name -> (shape, numpy dtype of
    SAFETENSORS_DTYPES)) stored in name order, and each array's (start, end) in the data that follows."""
    header, spans, offset = {"__metadata__": metadata}, {}, 0
    for name in sorted(layout):
        shape, dtype = layout[name]
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        spans[name] = (offset, offset + size)
        header[name] = {"dtype": SAFETENSORS_NAMES[np.dtype(dtype).newbyteorder("<").str], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8), spans


def _save(flat: dict, target: str, metadata: dict) -> None:
    """Write arrays of SAFETENSORS_DTYPES as a safetensors file (an 8-byte header size, the JSON header,
    the tensors' bytes in name order), each array straight from its memory: `safetensors.numpy.save_file`
    first copies every tensor into one bytes object (0.5 GB of fresh memory for a first load's weights)."""
    text, _ = _header({k: (v.shape, v.dtype) for k, v in flat.items()}, metadata)
    with open(target, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in sorted(flat):
            a = np.ascontiguousarray(flat[name], flat[name].dtype.newbyteorder("<"))
            if a.size:
                f.write(a.reshape(-1).view(np.uint8).data)


def _stored(dtype: np.dtype) -> np.dtype:
    """The dtype an array is stored as: its own, or (one safetensors' numpy API lacks, e.g. bfloat16)
    the unsigned integer of its width, its name recorded in the header's `dtypes`."""
    return dtype if dtype.kind in "fiub" else np.dtype(f"u{dtype.itemsize}")


PENDING = "pending-checksum"   # as wide as a checksum: `InPlace.commit` writes the real one over it


class InPlace:
    """A cache file written where its arrays live (`create`): `arrays` are views of a temporary file's
    shared mapping for the caller to fill, then `commit()` writes the checksum into the header and
    renames the file into place. The filled arrays are then the file's page-cache pages: a first load
    touches half the fresh memory of filling arrays and writing them out (on a VM whose host backs
    each fresh page lazily, seconds of a first process), and no write runs beside it."""

    def __init__(self, path: str, variant: str, source: str, target: str, tmp: str, header: bytes, arrays: dict):
        self.path, self.variant, self.source, self.target, self.tmp = path, variant, source, target, tmp
        self.header, self.arrays = header, arrays

    def commit(self) -> bool:
        """Seal and install the file (False, with a warning, when that fails: the arrays stay valid)."""
        try:
            sealed = self.header.replace(f'"checksum":"{PENDING}"'.encode(),
                                         f'"checksum":"{checksum(self.arrays)}"'.encode(), 1)   # of the bytes
            with open(self.tmp, "r+b") as f:
                f.seek(8)
                f.write(sealed)
            os.replace(self.tmp, self.target)
        except OSError as e:
            warnings.warn(f"could not write the weights cache: {e}", stacklevel=2)
            self.discard()
            return False
        if not self.variant:
            _evict_older(self.path, self.source)
        return True

    def discard(self) -> None:
        """Leave no file behind (the arrays stay valid: the mapping outlives the name)."""
        try:
            os.remove(self.tmp)
        except OSError:
            pass


def create(path: str, variant: str, layout: dict) -> InPlace | None:
    """An `InPlace` cache file for arrays of `layout` (flat name -> (shape, dtype), bfloat16 included)
    derived from `path` under `variant` ("" for its float32 params); None when the cache is off, this
    process does not write (not process 0) or the folder is not writable."""
    from hsd_jax import distributed

    if disabled() or not distributed.is_primary():
        return None
    layout = {k: (tuple(int(n) for n in shape), np.dtype(dt)) for k, (shape, dt) in layout.items()}
    dtypes = {k: dt.name for k, (_, dt) in layout.items() if _stored(dt) != dt}
    stored = {k: (shape, _stored(dt)) for k, (shape, dt) in layout.items()}
    try:
        source = fingerprint(path)
        target = cache_file(path, variant, source)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        header, spans = _header(stored, {"source": source, "variant": variant, "checksum": PENDING,
                                         "format": FORMAT, "dtypes": json.dumps(dtypes)})
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
    except OSError as e:
        warnings.warn(f"could not write the weights cache: {e}", stacklevel=2)
        return None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            f.flush()
            # the blocks reserved now: a full disk is an error here, not a SIGBUS when a mapped page is written
            os.posix_fallocate(f.fileno(), 0, 8 + len(header) + max((end for _, end in spans.values()), default=0))
        mm = np.memmap(tmp, mode="r+")
    except OSError as e:
        warnings.warn(f"could not write the weights cache: {e}", stacklevel=2)
        os.remove(tmp)
        return None
    base = 8 + len(header)
    arrays = {k: mm[base + a:base + b].view(stored[k][1]).reshape(shape).view(dt)
              for k, (a, b) in spans.items() for shape, dt in [layout[k]]}
    return InPlace(path, variant, source, target, tmp, header, arrays)


def _write(path: str, variant: str, flat: dict, source: str | None = None) -> str | None:
    """Write flat arrays (those of dtypes safetensors' numpy API lacks, e.g. bfloat16, as unsigned
    integers of their width, their dtype in the header) to a temporary file, then rename it. Process
    0 alone writes (a multi-process run's others only read, like every file the package writes); returns
    the source fingerprint it wrote under (`source`: taken when the arrays were, by a background
    write's caller), None when it wrote nothing."""
    from hsd_jax import distributed

    if disabled() or not distributed.is_primary():
        return None
    dtypes = {k: v.dtype.name for k, v in flat.items() if _stored(v.dtype) != v.dtype}
    flat = {k: v.view(_stored(v.dtype)) for k, v in flat.items()}
    try:
        source = source or fingerprint(path)
        target = cache_file(path, variant, source)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        meta = {"source": source, "variant": variant, "checksum": checksum(flat), "format": FORMAT,
                "dtypes": json.dumps(dtypes)}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
        os.close(fd)
        try:
            _save(flat, tmp, meta)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError as e:
        warnings.warn(f"could not write the weights cache: {e}", stacklevel=3)
        return None
    return source
