"""Tokenizers (and chat templates) through transformers, from a GGUF file or a HF directory."""
from __future__ import annotations

import os

from hsd_jax.loading.errors import ModelLoadError


def load_tokenizer(path: str):
    """A transformers tokenizer; `path` is a .gguf file or a model directory. Never touches a hub."""
    from transformers import AutoTokenizer

    try:
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from None
