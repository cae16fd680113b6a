"""The GGUF parser: the same fields and tensors as the `gguf` package's reader, and a clear
ModelLoadError (never a numpy or struct error) for a damaged file."""
import gguf
import numpy as np
import pytest

from hsd_jax.loading.errors import ModelLoadError
from hsd_jax.loading.gguf_file import read_gguf
from hsd_jax.loading.gguf_loader import default_gguf_path


def test_smollm2_fields_and_tensors_equal_the_gguf_packages_reader():
    path = default_gguf_path()
    ref, ours = gguf.GGUFReader(path), read_gguf(path)
    ref_fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ref_fields == ours.fields
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(t.shape.tolist()) and mine.tensor_type == t.tensor_type
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data, t.data)
    assert read_gguf(path) is ours                      # parsed once per file and process


def _small_gguf(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "<s>"])
    w.add_tensor("x.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_a_small_written_file_reads_back(tmp_path):
    _small_gguf(tmp_path / "ok.gguf")
    f = read_gguf(str(tmp_path / "ok.gguf"))
    assert f.fields["llama.block_count"] == 1 and f.fields["tokenizer.ggml.tokens"] == ["a", "bc", "<s>"]
    assert f.tensors["x.weight"].shape == (4, 3)
    assert np.array_equal(f.tensors["x.weight"].data, np.arange(12, dtype=np.float32).reshape(3, 4))


@pytest.mark.parametrize("damage", ["truncated_header", "truncated_data", "huge_length", "bad_magic", "empty"])
def test_damaged_files_are_clear_errors(tmp_path, damage):
    raw = _small_gguf(tmp_path / "ok.gguf")
    if damage == "truncated_header":
        raw = raw[:60]
    elif damage == "truncated_data":
        raw = raw[:-20]
    elif damage == "huge_length":
        key = raw.index(b"tokenizer.ggml.tokens")          # the key's u64 length precedes it
        raw = raw[:key - 8] + (2 ** 62).to_bytes(8, "little") + raw[key:]
    elif damage == "bad_magic":
        raw = b"GGUX" + raw[4:]
    else:
        raw = b""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        read_gguf(str(bad))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_fast_dequantize_is_bit_identical_to_gguf_quants(kind):
    """`gguf_loader.dequantize` (one pass per tensor) against gguf-py's reference decoder, on random
    weights with large, tiny and zero blocks, and on the embedded model's own tensors of that type."""
    from hsd_jax.loading.gguf_loader import dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(0).normal(size=(48, 256)).astype(np.float32)
    w[3] *= 1e4
    w[5] *= 1e-6
    w[7, :32] = 0
    raw = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(raw, qtype)
    got = dequantize(raw, kind)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    tensors = [t for t in read_gguf(default_gguf_path()).tensors.values() if t.tensor_type.name == kind]
    assert tensors
    for t in tensors[:8]:
        assert np.array_equal(dequantize(t.data, kind), gguf.quants.dequantize(t.data, t.tensor_type))
    assert dequantize(raw, "Q6_K") is None     # other types go to gguf-py
