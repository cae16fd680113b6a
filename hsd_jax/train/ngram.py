"""Build the n-gram floor drafter from self-distilled data: counting, no gradient steps."""
from __future__ import annotations

import os
import time

import numpy as np

from hsd_jax.train.data import load_shards


def build_ngram_drafter(data_dirs, target, out: str, top_k: int = 8, command: str = "") -> dict:
    """Count response bigrams in `data_dirs`, save the table as a drafter at `out` with a model
    card, and return a summary (pairs counted, tokens with a learned row)."""
    from hsd_jax.api import save_drafter
    from hsd_jax.models.drafter import Drafter
    from hsd_jax.models.ngram import NgramConfig, bigram_table, response_bigrams

    t0 = time.time()
    dirs = [data_dirs] if isinstance(data_dirs, str) else list(data_dirs)
    seqs, plens = load_shards(dirs)
    cfg = NgramConfig(vocab_size=target.config.vocab_size, top_k=top_k)
    table = bigram_table(seqs, plens, cfg)
    save_drafter(Drafter("ngram", table, cfg, None), out)
    pairs = response_bigrams(seqs, plens)
    summary = dict(pairs=len(pairs), tokens_with_row=len(np.unique(pairs[:, 0])), seconds=round(time.time() - t0, 1))
    card = [f"# ngram drafter for {target.name}", "",
            "The free floor among the HSD baselines: each token's most frequent next tokens in the self-distilled",
            "training responses (bigram counts), their log conditional frequencies as draft scores. Tokens",
            "never seen fall back to the most frequent tokens overall. No gradient steps.", "",
            f"- data: {', '.join(f'`{d}`' for d in dirs)}",
            f"- {summary['pairs']} response bigrams; {summary['tokens_with_row']} tokens have their own row; top_k {top_k}",
            f"- built in {summary['seconds']} s" + (f" with `{command}`" if command else ""), ""]
    from hsd_jax.distributed import is_primary

    if is_primary():
        with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
            f.write("\n".join(card))
    return summary
