"""Where `hsd tune`'s choices are kept and how `generate(..., tuned=True)` finds them.

A tuned choice (tree shape, and for HSD the reuse policy) holds for one hardware, one target
and one drafter, so it is stored under that key in a user cache folder, never in the installed
package: `$HSD_JAX_CACHE/tuned/` (default `$XDG_CACHE_HOME/hsd_jax` or `~/.cache/hsd_jax`).
Nothing reads it unless asked (`tuned=True`, `hsd generate --tuned`, `hsd bench --tuned`);
otherwise `engine.SpecConfig`'s defaults apply.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

from hsd_jax.config import InputError


def cache_dir() -> str:
    """The user cache folder for tuned trees (created on first write)."""
    base = os.environ.get("HSD_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hsd_jax")
    return os.path.join(base, "tuned")


def hardware_key() -> str:
    """e.g. `cpu-2cores`, `gpu-nvidia-h200`, `tpu-tpu-v5-lite`."""
    import jax

    backend = jax.default_backend()
    if backend == "cpu":
        return f"cpu-{os.cpu_count()}cores"
    kind = getattr(jax.devices()[0], "device_kind", backend)
    return f"{backend}-" + re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def drafter_fingerprint(drafter) -> str:
    """A short content hash of a saved drafter (its drafter.json and draft vocabulary), so a
    retrained drafter at the same path does not inherit the old one's tree."""
    h = hashlib.sha1(drafter.kind.encode())
    if drafter.path is None:
        h.update(b"random:" + repr(drafter.config).encode())
    else:
        for name in ("drafter.json", "d2t.npy"):
            p = os.path.join(drafter.path, name)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


def tuned_key(target, drafter) -> str:
    model = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(os.path.normpath(str(target.name))))
    return f"{hardware_key()}--{model}--{drafter.kind}-{drafter_fingerprint(drafter)}"


def tuned_path(target, drafter, folder: str | None = None) -> str:
    return os.path.join(folder or cache_dir(), tuned_key(target, drafter) + ".json")


def save_tuned(report: dict, target, drafter, folder: str | None = None) -> str:
    """Store a tune report where `tuned_options` finds it; in a multi-process run process 0 writes."""
    from hsd_jax.distributed import is_primary

    path = tuned_path(target, drafter, folder)
    if is_primary():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return path


# the choices a tuned file may hold, and their types; a damaged file fails here naming it
TUNED_FIELDS = {"tree_nodes": int, "tree_depth": int, "tree_top_k": int, "lookup_slots": int,
                "lookup_min_match": int, "reuse": str}


def load_tuned(target, drafter, folder: str | None = None) -> dict | None:
    from hsd_jax.loading.hf import read_json

    path = tuned_path(target, drafter, folder)
    if not os.path.isfile(path):
        return None
    report = read_json(path, InputError)
    if not isinstance(report.get("tree"), dict):
        raise InputError(f"{path}: damaged tuned choice (no 'tree' object); rerun `hsd tune` or delete the file")
    return report


def tuned_options(method: str, target, drafter, folder: str | None = None) -> dict:
    """The tree, lookup nodes and their shortest match (and for hsd the reuse policy) `hsd tune` chose for this hardware,
    target and drafter; a clear error when it was never run for them."""
    report = load_tuned(target, drafter, folder)
    if report is None:
        raise InputError(f"no tuned tree for {method} on this hardware ({hardware_key()}), target and drafter: "
                         f"run `hsd tune --method {method}` first (it writes {tuned_path(target, drafter, folder)}), "
                         "or drop tuned=True to use the defaults")
    opts = dict(report["tree"], lookup_slots=report.get("lookup_slots", 0))
    if "lookup_min_match" in report:
        opts["lookup_min_match"] = report["lookup_min_match"]
    if method == "hsd" and "reuse" in report:
        opts["reuse"] = report["reuse"]
    for k, v in opts.items():
        kind = TUNED_FIELDS.get(k)
        if kind is None or not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < k.startswith("tree")):
            raise InputError(f"{tuned_path(target, drafter, folder)}: damaged tuned choice {k}={v!r}; rerun "
                             "`hsd tune` or delete the file")
    return opts
