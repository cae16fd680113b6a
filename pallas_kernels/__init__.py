"""Pallas kernels for hsd-jax."""

from pallas_kernels.tree_attention import (
    ancestor_mask,
    resolve_attention_impl,
    tree_attention,
    tree_attention_pallas,
    tree_attention_reference,
)

__all__ = [
    "ancestor_mask",
    "resolve_attention_impl",
    "tree_attention",
    "tree_attention_pallas",
    "tree_attention_reference",
]
