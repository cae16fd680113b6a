"""Decoding methods, registered in one place. `ar` (the target alone) is the baseline every
method is checked against and is not in the registry: it has no drafter and no rounds.

Adding a method: a module with `init`, `draft`, `update`, a `DrafterKind` and a `METHOD`
record (see `base.py`), one line here, and its tests."""
from hsd_jax.config import InputError
from hsd_jax.methods import eagle, eagle3, hsd, lookup, ngram, sd
from hsd_jax.methods.base import Draft, DrafterKind, History, Method, Round

REGISTRY: dict[str, Method] = {m.name: m for m in (sd.METHOD, eagle.METHOD, eagle3.METHOD, hsd.METHOD, ngram.METHOD, lookup.METHOD)}
METHODS = ("ar",) + tuple(REGISTRY)
TREE_METHODS = tuple(name for name, m in REGISTRY.items() if m.drafts == "tree")


def get(name: str) -> Method:
    if name not in REGISTRY:
        raise InputError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return REGISTRY[name]


__all__ = ["REGISTRY", "METHODS", "TREE_METHODS", "get", "Draft", "DrafterKind", "History", "Method", "Round"]
