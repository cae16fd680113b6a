"""Untrusted files: every loader turns a damaged file into one typed error naming it.

The five cases issue 43 found (tracebacks before), at the API and at the command line (one
`error:` line, exit 2), then a corruption suite: for each format a valid small file is damaged
systematically (truncated at offsets inside the header and inside the data, bytes flipped in
both, JSON fields removed, renamed or of the wrong type, tensors of the wrong dtype or shape, an
index naming a missing shard) and every damaged copy must either raise the format's typed error,
one line naming the file, or (damage no check can see: tensor values, a renamed optional field)
load and run a tiny forward without crashing. Each case runs under an alarm, so a hang fails it.
The counts per format are printed at the end (`-s`)."""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import api, tuning
from hsd_jax.config import ConfigError, InputError
from hsd_jax.loading.errors import ModelLoadError
from hsd_jax.loading.tokenizer import bytes_to_unicode
from hsd_jax.train.data import DataError, shard_rows, write_shard
from hsd_jax.train.trainer import SequenceData
from tests.helpers import jax_logits, run_cli, save_hf_dir

TYPED = (ModelLoadError, InputError, ConfigError, DataError)
# a failed Orbax restore must leave nothing to finalize later (api._DrainingLoop): any coroutine or
# task failure reported after it would be a warning, and is an error here
pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.filterwarnings("error:coroutine .* was never awaited:RuntimeWarning")]
COUNTS: dict[str, Counter] = {}
CASE_SECONDS = 120   # a hang, not a slow compile on a loaded machine


# ---------------------------------------------------------------------------------------------
# Valid small files
# ---------------------------------------------------------------------------------------------

def write_tiny_gguf(path, hidden=16, heads=2, kv_heads=1, layers=1, skip=(), override=None, tensor_fn=None):
    """A tiny llama GGUF with a byte-level BPE tokenizer (256 byte tokens, one merge, two
    control tokens): what `hsd generate --model X.gguf` needs, in 40 kB. `skip` leaves metadata
    keys out, `override` writes others' values as given (wrong types), `tensor_fn(name, array)`
    changes tensors."""
    override = override or {}
    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)] + ["hi", "<|im_start|>", "<|im_end|>"]
    types = [1] * 257 + [3, 3]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    ints = {"llama.block_count": layers, "llama.context_length": 8192, "llama.embedding_length": hidden,
            "llama.feed_forward_length": 2 * hidden, "llama.attention.head_count": heads,
            "llama.attention.head_count_kv": kv_heads, "tokenizer.ggml.padding_token_id": vocab - 1}
    floats = {"llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5}
    strings = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm"}
    arrays = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["h i"], "tokenizer.ggml.token_type": types}
    for table, add in ((ints, w.add_uint32), (floats, w.add_float32), (strings, w.add_string), (arrays, w.add_array)):
        for key, value in table.items():
            if key in skip:
                continue
            writer = add
            if key in override:
                value = override[key]
                writer = w.add_string if isinstance(value, str) else w.add_array if isinstance(value, list) else add
            writer(key, value)
    rng = np.random.default_rng(0)
    dh = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * dh, hidden), f"blk.{i}.attn_k.weight": (kv_heads * dh, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * dh, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * dh),
                       f"blk.{i}.ffn_gate.weight": (2 * hidden, hidden), f"blk.{i}.ffn_up.weight": (2 * hidden, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, 2 * hidden)})
    for name, shape in shapes.items():
        value = (np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.3, shape)).astype(np.float32)
        value = tensor_fn(name, value) if tensor_fn else value
        if value is not None:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Valid originals: a tiny GGUF, HF directories (single file and sharded), a tiny hsd drafter
    (drafter.json, d2t.npy, Orbax params), a published EAGLE-3 directory, training data with its
    feature cache, and a tuned-choice file."""
    from safetensors.numpy import load_file, save_file

    from hsd_jax.models import eagle3
    from hsd_jax.train.features import build_feature_cache

    root = tmp_path_factory.mktemp("originals")
    out = {"root": root, "gguf": write_tiny_gguf(root / "tiny.gguf")}
    target = api.load_target(out["gguf"], max_cache_len=64)
    out["target"] = target
    save_hf_dir(target, root / "hf")   # the same model: one compiled decode loop serves both formats
    hf = api.load_target(str(root / "hf"), tokenizer=False, max_cache_len=64)
    assert hf.config == target.config
    out["hf_target"] = hf
    out["hf"] = root / "hf"
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    sharded = root / "hf_sharded"
    sharded.mkdir()
    shutil.copy(root / "hf" / "config.json", sharded / "config.json")
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in parts.items():
        save_file({k: tensors[k] for k in part}, str(sharded / fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in parts.items() for k in part}}))
    out["hf_sharded"] = sharded
    drafter = api.load_drafter("hsd", target=target, random_init=True, draft_vocab_size=128)
    api.save_drafter(drafter, str(root / "drafter"))
    out["drafter"] = root / "drafter"
    e3 = api.load_drafter("eagle3", target=hf, random_init=True)
    eagle3.export_published(e3.params, e3.config, e3.d2t, str(root / "eagle3"))
    out["eagle3"] = root / "eagle3"
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, 259, n)) for n in (12, 9, 14, 10)]
    write_shard(str(data / "shard_00000.npz"), seqs, [3, 2, 4, 3])
    build_feature_cache(hf, str(data), str(root / "features"), progress=False)
    out["data"], out["features"] = data, root / "features"
    return out


# ---------------------------------------------------------------------------------------------
# Damage and outcomes
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def alarm(seconds: int, what: str):
    def fire(signum, frame):
        raise TimeoutError(f"{what}: no answer in {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def attempt(fmt: str, case: str, names: str, load, run=None):
    """Load one damaged copy: a typed error must be one line naming `names` (its file or
    directory); a copy that loads must then `run` without crashing. Anything else fails the test."""
    with alarm(CASE_SECONDS, f"{fmt} {case}"):
        try:
            obj = load()
        except TYPED as e:
            msg = str(e)
            assert "\n" not in msg and names in msg, f"{fmt} {case}: unclear error {msg!r}"
            COUNTS.setdefault(fmt, Counter())["error"] += 1
            return "error"
        except Exception as e:   # the failure this suite exists to catch
            raise AssertionError(f"{fmt} {case}: {type(e).__name__} instead of a typed error: {e}") from e
        if run is not None:
            run(obj)
        COUNTS.setdefault(fmt, Counter())["loaded"] += 1
        return "loaded"


def truncations(raw: bytes, header_end: int) -> list[int]:
    """Lengths to cut to: empty, inside the magic / size fields, spread over the header, at its
    end, spread over the data, one byte short."""
    inside_header = np.linspace(9, header_end - 1, 8).astype(int).tolist()
    inside_data = np.linspace(header_end + 1, len(raw) - 1, 5).astype(int).tolist()
    return sorted({0, 3, 7, header_end, len(raw) - 1, *inside_header, *inside_data})


def flips(raw: bytes, lo: int, hi: int, n: int, mask: int) -> list[tuple[int, bytes]]:
    """n copies, each with one byte in [lo, hi) XORed with `mask`."""
    out = []
    for pos in np.linspace(lo, hi - 1, n).astype(int).tolist():
        b = bytearray(raw)
        b[pos] ^= mask
        out.append((pos, bytes(b)))
    return out


def byte_damage(raw: bytes, header_end: int, header: tuple, data: tuple, lo: int = 0) -> list[tuple[str, bytes]]:
    """(case, damaged copy) of a file: its `truncations`, then header bytes in [lo, header_end) flipped
    (`header`: (count, mask) pairs) and data bytes flipped (`data`: (count, mask))."""
    out = [(f"cut at {n}", raw[:n]) for n in truncations(raw, header_end)]
    for count, mask in header:
        out += [(f"header byte {pos} flipped", b) for pos, b in flips(raw, lo, header_end, count, mask)]
    return out + [(f"data byte {pos} flipped", b) for pos, b in flips(raw, header_end, len(raw), *data)]


def run_target(target):
    """A tiny forward (one small jitted program, shared by every copy of the same shapes) and the tokenizer."""
    logits = jax_logits(target.params, target.config, [[1, 2, 3]])
    assert logits.shape == (1, 3, target.config.vocab_size)
    if target.tokenizer is not None:
        target.decode(target.encode("hi there"))


def _first_tensor_offset(path) -> int:
    return int(gguf.GGUFReader(str(path)).data_offset)


def safetensors_header_end(path) -> int:
    raw = open(path, "rb").read(8)
    return 8 + int.from_bytes(raw, "little")


# ---------------------------------------------------------------------------------------------
# Issue 43's five cases
# ---------------------------------------------------------------------------------------------

def _five_cases(files, tmp_path):
    """The five damaged inputs of issue 43 on the tiny files: (name, drafter dir or None, model)."""
    cases = []
    d = tmp_path / "no_config"
    shutil.copytree(files["drafter"], d)
    (d / "drafter.json").write_text(json.dumps({"kind": "hsd", "oops": 1}))
    cases.append(("drafter.json without config", d, files["gguf"]))
    d = tmp_path / "cut_params"
    shutil.copytree(files["drafter"], d)
    data_files = [os.path.join(r, f) for r, _, fs in os.walk(d / "params") for f in fs if os.sep + "d" in r]
    os.truncate(max(data_files, key=os.path.getsize), 1000)
    cases.append(("params data file cut to 1000 bytes", d, files["gguf"]))
    h = tmp_path / "half"
    shutil.copytree(files["hf"], h)
    st = h / "model.safetensors"
    os.truncate(st, st.stat().st_size // 2)
    cases.append(("safetensors cut in half", None, h))
    h = tmp_path / "header"
    shutil.copytree(files["hf"], h)
    raw = bytearray((h / "model.safetensors").read_bytes())
    raw[8:40] = b"\x00" * 32
    (h / "model.safetensors").write_bytes(bytes(raw))
    cases.append(("32 header bytes overwritten", None, h))
    d = tmp_path / "float_d2t"
    shutil.copytree(files["drafter"], d)
    np.save(d / "d2t.npy", np.zeros(128, np.float32))
    cases.append(("d2t.npy of float zeros", d, files["gguf"]))
    return cases


def test_issue_cases_are_typed_errors_from_the_api(files, tmp_path):
    for name, drafter, model in _five_cases(files, tmp_path):
        with pytest.raises((ModelLoadError, InputError)) as err:
            target = files["target"] if drafter is not None else api.load_target(str(model), tokenizer=False)
            api.load_drafter("hsd", str(drafter), target=target)
        assert str(drafter or model) in str(err.value) and "\n" not in str(err.value), (name, err.value)


def test_issue_cases_are_one_error_line_and_exit_2(files, tmp_path):
    for name, drafter, model in _five_cases(files, tmp_path):
        args = ["generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "2"]
        if drafter is not None:
            args += ["--method", "hsd", "--drafter", drafter]
        res = run_cli(*args)
        gc.collect()
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2, (name, res.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(drafter or model) in lines[0], (name, lines)


def test_orbax_damage_is_one_stderr_line_from_a_fresh_process(files, tmp_path):
    """The chattiest case in a real `hsd` process: Orbax logs what it fails to parse and leaves its
    other reads' coroutines to finalizers; stderr must still be the one error line."""
    _, drafter, model = _five_cases(files, tmp_path)[1]
    res = subprocess.run([sys.executable, "-m", "hsd_jax", "generate", "--model", str(model), "--prompt", "hi",
                          "--max-new-tokens", "2", "--method", "hsd", "--drafter", str(drafter)],
                         capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)),
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {drafter}"), res.stderr


def test_issue_cases_on_the_shipped_drafters(smol, tmp_path):
    """The issue's own files: a shipped drafter with a params data file cut to 1,000 bytes, and one
    whose d2t.npy holds 8,192 float32 zeros."""
    shipped = api.shipped_drafter("hsd", smol)
    cut, zeros = tmp_path / "cut", tmp_path / "zeros"
    for d in (cut, zeros):
        shutil.copytree(shipped, d)
    data_files = [os.path.join(r, f) for r, _, fs in os.walk(cut / "params") for f in fs if os.sep + "d" in r]
    os.truncate(max(data_files, key=os.path.getsize), 1000)
    np.save(zeros / "d2t.npy", np.zeros(len(np.load(os.path.join(shipped, "d2t.npy"))), np.float32))
    with pytest.raises(ModelLoadError, match="damaged Orbax checkpoint.*OUT_OF_RANGE"):
        api.load_drafter("hsd", str(cut), target=smol)
    with pytest.raises(ModelLoadError, match="integer target ids, got float32"):
        api.load_drafter("hsd", str(zeros), target=smol)


# ---------------------------------------------------------------------------------------------
# The corruption suite, format by format
# ---------------------------------------------------------------------------------------------

def test_gguf(files, tmp_path):
    src = files["gguf"]
    raw = open(src, "rb").read()
    header_end = _first_tensor_offset(src)
    bad = tmp_path / "bad.gguf"
    load = lambda: api.load_target(str(bad), max_cache_len=64)

    def try_bytes(case, data):
        bad.write_bytes(data)
        attempt("gguf", case, str(bad), load, run_target)

    for case, data in byte_damage(raw, header_end, ((48, 0x01), (16, 0xFF)), (6, 0x40), lo=4):
        try_bytes(case, data)
    required = ("llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    for key in required:
        write_tiny_gguf(bad, skip=(key,))
        attempt("gguf", f"no {key}", str(bad), load, run_target)
    for key, value in (("llama.block_count", "one"), ("llama.embedding_length", [16]),
                       ("llama.attention.head_count", "2"), ("llama.rope.freq_base", "1e4"),
                       ("tokenizer.ggml.tokens", [1, 2, 3]), ("tokenizer.ggml.merges", "h i"),
                       ("tokenizer.ggml.padding_token_id", "x")):
        write_tiny_gguf(bad, override={key: value})
        attempt("gguf", f"{key} = {value!r}", str(bad), load, run_target)
    for what, fn in (("int32 weights", lambda n, v: v.astype(np.int32) if n == "blk.0.attn_q.weight" else v),
                     ("wrong shape", lambda n, v: v[:, :8] if n == "blk.0.ffn_up.weight" else v),
                     ("a 3-d embedding", lambda n, v: v.reshape(1, *v.shape) if n == "token_embd.weight" else v),
                     ("missing tensor", lambda n, v: None if n == "blk.0.ffn_down.weight" else v)):
        write_tiny_gguf(bad, tensor_fn=fn)
        attempt("gguf", what, str(bad), load, run_target)
    for what, kw in (("more layers than tensors", dict(layers=1, override={"llama.block_count": 2**31})),):
        write_tiny_gguf(bad, **kw)
        attempt("gguf", what, str(bad), load, run_target)


def _hf_cases(fmt, files, tmp_path, st_name, make_dir):
    """Damage one safetensors file of an HF directory (made by `make_dir`) systematically."""
    d = make_dir(tmp_path / "bad")
    st = d / st_name
    raw = st.read_bytes()
    header_end = safetensors_header_end(st)
    load = lambda: api.load_target(str(d), tokenizer=False, max_cache_len=64)

    def try_bytes(case, data):
        st.write_bytes(data)
        attempt(fmt, case, str(d), load, run_target)

    for case, data in byte_damage(raw, header_end, ((28, 0x01), (8, 0xFF)), (4, 0x40)):
        try_bytes(case, data)
    st.write_bytes(raw)
    return d


def test_hf_safetensors(files, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _hf_cases("hf", files, tmp_path, "model.safetensors", lambda p: shutil.copytree(files["hf"], p))
    load = lambda: api.load_target(str(d), tokenizer=False, max_cache_len=64)
    config = json.loads((d / "config.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))

    def try_config(case, cfg):
        (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
        attempt("hf", case, str(d), load, run_target)

    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        try_config(f"no {key}", {k: v for k, v in config.items() if k != key})
        try_config(f"{key} renamed", {(k + "_x" if k == key else k): v for k, v in config.items()})
    for key, value in (("hidden_size", "16"), ("hidden_size", 16.5), ("num_hidden_layers", None),
                       ("num_attention_heads", [2]), ("vocab_size", True), ("rope_theta", "big"),
                       ("rms_norm_eps", {}), ("tie_word_embeddings", "no"), ("rope_scaling", [1]),
                       ("rope_scaling", {"rope_type": "llama3", "factor": "x"}), ("eos_token_id", ["a"]),
                       ("num_key_value_heads", 3), ("num_hidden_layers", 10**12), ("hidden_size", -16)):
        try_config(f"{key} = {value!r}", dict(config, **{key: value}))
    for text in ("", "{", "[1, 2]", "null", '{"model_type": "llama"'):
        try_config(f"config.json {text!r}", text)
    (d / "config.json").write_text(json.dumps(config))
    name = "model.layers.0.mlp.up_proj.weight"
    for what, value in (("int32", tensors[name].astype(np.int32)), ("bool", tensors[name] > 0),
                        ("wrong shape", tensors[name][:, :8].copy()), ("float16", tensors[name].astype(np.float16)),
                        ("missing", None)):
        changed = dict(tensors)
        if value is None:
            del changed[name]
        else:
            changed[name] = value
        save_file(changed, str(d / "model.safetensors"))
        attempt("hf", f"{name} {what}", str(d), load, run_target)


def test_hf_tokenizer_json(files, tmp_path):
    """A HF directory's tokenizer.json (here the tiny GGUF's tokenizer saved by transformers)."""
    d = shutil.copytree(files["hf"], tmp_path / "bad")
    files["target"].tokenizer.save_pretrained(str(d))
    tok = d / "tokenizer.json"
    raw = tok.read_bytes()
    load = lambda: api.load_target(str(d), max_cache_len=64)
    assert load().tokenizer is not None

    def try_text(case, value):
        tok.write_bytes(value)
        attempt("hf tokenizer", case, str(d), load, run_target)

    for n in sorted({0, 1, 40, len(raw) // 3, len(raw) // 2, len(raw) - 2}):
        try_text(f"cut at {n}", raw[:n])
    for pos, value in flips(raw, 0, len(raw), 6, 0x80):   # each copy is a transformers load: a few
        try_text(f"byte {pos} flipped", value)
    parsed = json.loads(raw)
    for key in ("model", "added_tokens", "pre_tokenizer"):
        try_text(f"no {key}", json.dumps({k: v for k, v in parsed.items() if k != key}).encode())
        try_text(f"{key} a number", json.dumps(dict(parsed, **{key: 7})).encode())
    try_text("merges of unknown tokens", json.dumps(dict(parsed, model=dict(parsed["model"], merges=["zz qq"]))).encode())


def test_hf_sharded_with_index(files, tmp_path):
    def sharded(p):
        return shutil.copytree(files["hf_sharded"], p)

    d = _hf_cases("hf-sharded", files, tmp_path, "model-00002-of-00002.safetensors", sharded)
    load = lambda: api.load_target(str(d), tokenizer=False, max_cache_len=64)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    first = sorted(wm)[0]

    def try_index(case, value):
        (d / "model.safetensors.index.json").write_text(value if isinstance(value, str) else json.dumps(value))
        attempt("hf-sharded", case, str(d), load, run_target)

    try_index("a missing shard", dict(index, weight_map=dict(wm, **{first: "model-00003-of-00002.safetensors"})))
    try_index("the other shard", dict(index, weight_map=dict(
        wm, **{first: next(v for v in set(wm.values()) if v != wm[first])})))
    try_index("a path outside", dict(index, weight_map=dict(wm, **{first: "../hf/model.safetensors"})))
    try_index("a number", dict(index, weight_map=dict(wm, **{first: 7})))
    try_index("a tensor left out", dict(index, weight_map={k: v for k, v in wm.items() if k != first}))
    try_index("no weight_map", {"metadata": {}})
    try_index("weight_map a list", {"weight_map": list(wm)})
    for text in ("", "{", "[]", "7"):
        try_index(f"index {text!r}", text)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    os.remove(d / "model-00001-of-00002.safetensors")
    attempt("hf-sharded", "shard deleted", str(d), load, run_target)


def _drafter_copy(files, tmp_path, name="bad"):
    d = tmp_path / name
    if d.exists():
        shutil.rmtree(d)
    return shutil.copytree(files["drafter"], d)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _hsd_forward(params, cfg, view, feats, tokens):
    """The hsd drafter's layer over true features [1, T, d] from an empty cache, then its read-out."""
    from hsd_jax.cache import init_cache
    from hsd_jax.methods import hsd
    from hsd_jax.models.drafter import readout

    lcfg = cfg.layer_config()
    cache = init_cache(lcfg.num_layers, 1, lcfg.num_kv_heads, 8, lcfg.head_dim)
    g, _ = hsd.ingest(params, cfg, cache, feats, None, jnp.array([feats.shape[1]], jnp.int32))
    return readout(params, cfg, view, g, tokens)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _eagle3_forward(params, cfg, target_embedding, aux, tokens):
    """An EAGLE-3 drafter's layer over fused target features aux [3, 1, T, H] from an empty cache, then its head."""
    from hsd_jax.cache import init_cache
    from hsd_jax.models import eagle3

    emb = jnp.take(eagle3.embedding(params, target_embedding), tokens, axis=0)
    cache = init_cache(1, 1, cfg.num_kv_heads, 8, cfg.head_dim)
    h, _ = eagle3.layer(params, cfg, eagle3.fuse(params, aux), emb, jnp.arange(tokens.shape[1])[None], cache)
    return eagle3.logits(params, cfg, h, emb)


def _run_drafter(files):
    """A tiny forward of a loaded hsd drafter (one small jitted program for every copy of its shapes)."""
    from hsd_jax.models.drafter import target_view

    target = files["target"]

    def run(drafter):
        view = target_view(target.params, target.config, drafter.d2t)
        feats = jnp.ones((1, 3, drafter.config.hidden_size), jnp.float32)
        logits = _hsd_forward(drafter.params, drafter.config, view, feats, jnp.array([[1, 2, 3]], jnp.int32))
        assert logits.shape == (1, 3, drafter.config.vd)
    return run


def test_orbax_drafter_params(files, tmp_path):
    original = sorted(os.path.relpath(os.path.join(r, f), files["drafter"] / "params")
                      for r, _, fs in os.walk(files["drafter"] / "params") for f in fs)
    load = lambda d: (lambda: api.load_drafter("hsd", str(d), target=files["target"]))
    run = _run_drafter(files)
    data_files = [rel for rel in original if os.sep + "d" + os.sep in os.sep + rel]
    for rel in original:
        size = os.path.getsize(files["drafter"] / "params" / rel)
        data = rel in data_files   # several alike: each cut inside and flipped in the middle
        for n in sorted(({size // 2} if data else {0, size // 2}) - {size}):
            d = _drafter_copy(files, tmp_path)
            os.truncate(d / "params" / rel, n)
            attempt("orbax", f"{rel} cut at {n}", str(d), load(d), run)
        for pos in sorted({size // 2} if data else {0, size // 2}) if size else []:
            d = _drafter_copy(files, tmp_path)
            p = d / "params" / rel
            b = bytearray(p.read_bytes())
            b[pos] ^= 0x01
            p.write_bytes(bytes(b))
            attempt("orbax", f"{rel} byte {pos} flipped", str(d), load(d), run)
        if not data or rel == data_files[0]:
            d = _drafter_copy(files, tmp_path)
            os.remove(d / "params" / rel)
            attempt("orbax", f"{rel} deleted", str(d), load(d), run)
    d = _drafter_copy(files, tmp_path)
    shutil.rmtree(d / "params")
    attempt("orbax", "no params", str(d), load(d), run)
    other = api.load_drafter("hsd", target=files["target"], random_init=True, draft_vocab_size=128,
                             intermediate_size=8)
    api.save_drafter(other, str(tmp_path / "other"))
    d = _drafter_copy(files, tmp_path)
    shutil.rmtree(d / "params")
    shutil.copytree(tmp_path / "other" / "params", d / "params")
    attempt("orbax", "params of another shape", str(d), load(d), run)


def test_drafter_json(files, tmp_path):
    info = json.loads((files["drafter"] / "drafter.json").read_text())
    cfg = info["config"]
    d = _drafter_copy(files, tmp_path)
    load = lambda: api.load_drafter("hsd", str(d), target=files["target"])
    run = _run_drafter(files)

    def try_json(case, value):
        (d / "drafter.json").write_text(value if isinstance(value, str) else json.dumps(value))
        attempt("drafter.json", case, str(d), load, run)

    for text in ("", "{", "[]", "null", '"hsd"', json.dumps(info)[:-5]):
        try_json(f"text {text[:12]!r}", text)
    try_json("no kind", {"config": cfg})
    try_json("no config", {"kind": "hsd", "oops": 1})
    try_json("config a list", {"kind": "hsd", "config": list(cfg)})
    try_json("kind eagle", dict(info, kind="eagle"))
    try_json("kind 7", dict(info, kind=7))
    for key in cfg:
        try_json(f"no {key}", dict(info, config={k: v for k, v in cfg.items() if k != key}))
        try_json(f"{key} renamed", dict(info, config={(k + "_x" if k == key else k): v for k, v in cfg.items()}))
        wrong = "x" if not isinstance(cfg[key], str) else 3
        try_json(f"{key} = {wrong!r}", dict(info, config=dict(cfg, **{key: wrong})))
    for key, value in (("hidden_size", 16.0), ("hidden_size", 17), ("num_heads", 0), ("num_kv_heads", [1]),
                       ("feature_layers", [0, "a"]), ("feature_layers", 3), ("draft_vocab_size", 10**9),
                       ("feature_rms", -1.0), ("vocab_size", None), ("rope_theta", True)):
        try_json(f"{key} = {value!r}", dict(info, config=dict(cfg, **{key: value})))


def test_d2t_npy(files, tmp_path):
    d = _drafter_copy(files, tmp_path)
    raw = (files["drafter"] / "d2t.npy").read_bytes()
    good = np.load(files["drafter"] / "d2t.npy")
    load = lambda: api.load_drafter("hsd", str(d), target=files["target"])
    run = _run_drafter(files)
    header_end = raw.index(b"\n") + 1

    def try_bytes(case, data):
        (d / "d2t.npy").write_bytes(data)
        attempt("d2t.npy", case, str(d), load, run)

    def try_array(case, arr):
        np.save(d / "d2t.npy", arr)
        attempt("d2t.npy", case, str(d), load, run)

    for case, data in byte_damage(raw, header_end, ((12, 0x01),), (3, 0x01)):
        try_bytes(case, data)
    try_array("float zeros", np.zeros(len(good), np.float32))
    try_array("2-d", good.reshape(2, -1))
    try_array("too short", good[:-1])
    try_array("beyond the vocabulary", good + 1000)
    try_array("negative", good - 1000)
    try_array("strings", good.astype(str))
    try_array("a scalar", np.int32(3))
    try_bytes("pickled objects", _pickled_npy())
    np.savez(d / "d2t.npz", d2t=good)
    try_bytes("an npz", (d / "d2t.npz").read_bytes())


def _pickled_npy() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return buf.getvalue()


def test_published_eagle3(files, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = shutil.copytree(files["eagle3"], tmp_path / "bad")
    st = d / "model.safetensors"
    raw = st.read_bytes()
    header_end = safetensors_header_end(st)
    hf = files["hf_target"]
    load = lambda: api.load_drafter("eagle3", str(d), target=hf)

    def run(drafter):
        aux = jnp.ones((3, 1, 3, hf.config.hidden_size), jnp.float32)
        logits = _eagle3_forward(drafter.params, drafter.config, hf.params["embed_tokens"]["embedding"], aux,
                                 jnp.array([[1, 2, 3]], jnp.int32))
        assert logits.shape == (1, 3, drafter.config.vd)

    def try_bytes(case, data):
        st.write_bytes(data)
        attempt("eagle3", case, str(d), load, run)

    for case, data in byte_damage(raw, header_end, ((24, 0x01),), (3, 0x40)):
        try_bytes(case, data)
    st.write_bytes(raw)
    config = json.loads((d / "config.json").read_text())

    def try_config(case, cfg):
        (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
        attempt("eagle3", case, str(d), load, run)

    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        try_config(f"no {key}", {k: v for k, v in config.items() if k != key})
        try_config(f"{key} = 'x'", dict(config, **{key: "x"}))
    for key, value in (("architectures", "LlamaForCausalLMEagle3"), ("architectures", ["BertModel"]),
                       ("eagle_config", [1]), ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, "a", 1]}),
                       ("eagle_config", {"eagle_aux_hidden_state_layer_ids": 5}), ("num_hidden_layers", 2),
                       ("draft_vocab_size", 10**6), ("rope_theta", None), ("head_dim", 3.5)):
        try_config(f"{key} = {value!r}", dict(config, **{key: value}))
    for text in ("", "{", "[]"):
        try_config(f"config.json {text!r}", text)
    (d / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(st))
    for what, name, value in (("float d2t", "d2t", tensors["d2t"].astype(np.float32)),
                              ("d2t out of range", "d2t", tensors["d2t"] + 10**6),
                              ("int fc", "fc.weight", tensors["fc.weight"].astype(np.int32)),
                              ("fc wrong shape", "fc.weight", tensors["fc.weight"][:, :5].copy()),
                              ("no norm", "norm.weight", None)):
        changed = dict(tensors)
        if value is None:
            del changed[name]
        else:
            changed[name] = value
        save_file(changed, str(st))
        attempt("eagle3", what, str(d), load, run)


def test_training_shards_and_feature_caches(files, tmp_path):
    data = shutil.copytree(files["data"], tmp_path / "data")
    shard = data / "shard_00000.npz"
    raw = shard.read_bytes()
    good = dict(np.load(shard))

    def try_bytes(case, value):
        shard.write_bytes(value)
        attempt("training data", case, str(shard), lambda: shard_rows(str(shard)))

    def try_arrays(case, arrays):
        np.savez(shard, **arrays)
        attempt("training data", case, str(shard), lambda: shard_rows(str(shard)))

    for n in sorted({0, 10, 30, 60, len(raw) // 2, len(raw) - 20, len(raw) - 1}):
        try_bytes(f"cut at {n}", raw[:n])
    for pos, value in flips(raw, 0, len(raw), 10, 0xFF):
        try_bytes(f"byte {pos} flipped", value)
    for key in good:
        try_arrays(f"no {key}", {k: v for k, v in good.items() if k != key})
        try_arrays(f"{key} float", dict(good, **{key: good[key].astype(np.float32)}))
    try_arrays("lengths past the width", dict(good, lengths=good["lengths"] + 100))
    try_arrays("prompt past the length", dict(good, prompt_lens=good["lengths"] + 1))
    try_arrays("one length short", dict(good, lengths=good["lengths"][:-1]))
    try_arrays("tokens 1-d", dict(good, tokens=good["tokens"].ravel()))
    try_arrays("negative tokens", dict(good, tokens=good["tokens"] - 100))
    np.savez(shard, **good)
    feats = tmp_path / "features"
    shutil.copytree(files["features"], feats)
    cache = next(p for p in feats.rglob("feat_*.npy"))
    craw = cache.read_bytes()
    good_f = np.load(cache)
    load = lambda: SequenceData(str(data), str(feats), window=8, holdout=0.25, seed=0)
    header_end = craw.index(b"\n") + 1

    def try_cache(case, value):
        if isinstance(value, bytes):
            cache.write_bytes(value)
        else:
            np.save(cache, value)
        attempt("feature cache", case, str(cache), load, lambda sd: sd.batch(sd.train))

    for n in truncations(craw, header_end):
        try_cache(f"cut at {n}", craw[:n])
    for pos, value in flips(craw, 0, header_end, 8, 0x01):
        try_cache(f"header byte {pos} flipped", value)
    try_cache("one row short", good_f[:-1])
    try_cache("too short", good_f[:, :4])
    try_cache("2-d", good_f[:, :, 0])
    try_cache("integer", good_f.astype(np.int16))
    try_cache("pickled objects", _pickled_npy())
    from hsd_jax.train.data import gsm8k_questions, sharegpt_user_turns

    src = tmp_path / "gsm8k.jsonl"
    for case, text in (("no question", '{"q": "a"}\n'), ("cut", '{"question": "a"}\n{"quest'),
                       ("a number", '{"question": 7}\n'), ("a list", "[1]\n"), ("bytes", "\udcff")):
        src.write_text(text, errors="surrogateescape")
        attempt("training data", f"gsm8k {case}", str(src), lambda: gsm8k_questions(str(src)))
    for case, text in (("no list", "{}"), ("not json", "\x00\x01")):
        src.write_text(text)
        attempt("training data", f"sharegpt {case}", str(src), lambda: sharegpt_user_turns(str(src)))


def test_tuned_choice_files(files, tmp_path):
    target = files["target"]
    drafter = api.load_drafter("hsd", str(files["drafter"]), target=target)
    report = {"tree": {"tree_nodes": 4, "tree_depth": 2, "tree_top_k": 2}, "lookup_slots": 0, "reuse": "none"}
    path = tuning.save_tuned(report, target, drafter, str(tmp_path))
    load = lambda: tuning.tuned_options("hsd", target, drafter, str(tmp_path))
    assert load() == {"tree_nodes": 4, "tree_depth": 2, "tree_top_k": 2, "lookup_slots": 0, "reuse": "none"}
    raw = open(path, "rb").read()

    def try_file(case, value):
        with open(path, "wb" if isinstance(value, bytes) else "w") as f:
            f.write(value if isinstance(value, (bytes, str)) else json.dumps(value))
        attempt("tuned choice", case, path, load)

    for n in sorted({0, 1, len(raw) // 3, len(raw) // 2, len(raw) - 1}):
        try_file(f"cut at {n}", raw[:n])
    for pos, value in flips(raw, 0, len(raw), 6, 0x80):
        try_file(f"byte {pos} flipped", value)
    try_file("no tree", {"lookup_slots": 0})
    try_file("a list", [report])
    for key, value in (("tree_nodes", "4"), ("tree_depth", None), ("tree_top_k", 0), ("tree_nodes", 2.5),
                       ("tree_size", 4)):
        try_file(f"tree {key} = {value!r}", dict(report, tree=dict(report["tree"], **{key: value})))
    for key, value in (("lookup_slots", "x"), ("reuse", 3), ("lookup_min_match", -1)):
        try_file(f"{key} = {value!r}", dict(report, **{key: value}))


def test_summary_counts_at_least_200_damaged_files():
    """How many damaged files each format tried, and their outcomes (printed)."""
    total = sum(sum(c.values()) for c in COUNTS.values())
    lines = [f"{fmt:>14}: {sum(c.values()):4d} damaged files, {c['error']:4d} typed errors, "
             f"{c['loaded']:3d} loaded and ran" for fmt, c in COUNTS.items()]
    print("\ncorruption suite\n" + "\n".join(lines) + f"\n{'total':>14}: {total:4d}")
    assert len(COUNTS) == 11 and total >= 200, COUNTS
