"""A read-only GGUF parser: metadata as Python values, tensors as memory-mapped numpy arrays.

`gguf.GGUFReader` builds one numpy view per array element: opening SmolLM2's file (49k tokens,
49k merges) takes about 4 s, and a load opened it twice (weights, tokenizer). This reads the same
layout (GGUF v2/v3, little-endian) with `struct` in a fraction of a second, checks every length
against the file (model files are untrusted input), and is cached per file so the weights and the
tokenizer share one parse. Quantized blocks are still decoded by `gguf.quants`."""
from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from hsd_jax.loading.errors import ModelLoadError, reading

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
           12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in ggml order (fastest dimension first), `data` laid out as
    `gguf.quants.dequantize` expects (typed for plain types, bytes per row for quantized ones)."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: str
    fields: dict
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ModelLoadError(f"{self.path}: truncated GGUF header at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: GGUF length {n} at byte {self.pos} runs past the file end")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def string(self) -> str:
        raw = self.take(self.unpack("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise ModelLoadError(f"{self.path}: a GGUF string before byte {self.pos} is not UTF-8") from None

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype == _STRING:
                if count > len(self.buf) - self.pos:
                    raise ModelLoadError(f"{self.path}: GGUF array of {count} strings is longer than the file")
                return [self.string() for _ in range(count)]
            if itype in _SCALAR:
                dtype = np.dtype(_SCALAR[itype])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
            raise ModelLoadError(f"{self.path}: unsupported GGUF array item type {itype}")
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def _parse(path: str) -> GGUFFile:
    """The checked parse; any other failure on a damaged file (numpy, gguf) still names the file."""
    with reading(path, "damaged GGUF file"):
        return _parse_checked(path)


def _parse_checked(path: str) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        mm = np.memmap(path, mode="r")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from None
    if len(mm) < 24 or bytes(mm[:4]) != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
    cur = _Cursor(memoryview(mm), path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                             "big-endian files are not)")
    n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise ModelLoadError(f"{path}: tensor {name} claims {n_dims} dimensions")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        raw_type, offset = cur.unpack("<I"), cur.unpack("<Q")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {raw_type}") from None
        infos.append((name, dims, qtype, offset))
    align = fields.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ModelLoadError(f"{path}: general.alignment {align} is not a power of two")
    start = -(-cur.pos // align) * align
    tensors = {}
    for name, dims, qtype, offset in infos:
        if name in tensors:
            raise ModelLoadError(f"{path}: tensor {name} appears twice")
        block, type_size = GGML_QUANT_SIZES[qtype]
        np_dims = tuple(reversed(dims)) or (1,)
        n_elems = math.prod(dims)   # Python ints: damaged dimensions must not wrap around
        if np_dims[-1] % block:
            raise ModelLoadError(f"{path}: tensor {name} row of {np_dims[-1]} is not whole {qtype.name} blocks")
        n_bytes = n_elems // block * type_size
        begin = start + offset
        if begin + n_bytes > len(mm):
            raise ModelLoadError(f"{path}: tensor {name} runs past the end of the file")
        dtype = _PLAIN_DTYPES.get(qtype.name)
        if dtype is None:
            data = mm[begin:begin + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        else:
            data = mm[begin:begin + n_bytes].view(dtype).reshape(np_dims)
        tensors[name] = GGUFTensor(name, qtype, dims, data)
    return GGUFFile(path, fields, tensors)


@functools.lru_cache(maxsize=2)
def _cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return _parse(path)


def read_gguf(path: str) -> GGUFFile:
    """The parsed file; parsed once per (path, modification time, size) in a process."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    st = os.stat(path)
    return _cached(os.path.realpath(path), st.st_mtime_ns, st.st_size)
