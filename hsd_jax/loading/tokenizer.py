"""Tokenizers (and chat templates) from a GGUF file or a HF directory, without PyTorch.

A HF directory has a `tokenizer.json`: `AutoTokenizer.from_pretrained` reads it (no torch).

A GGUF has no `tokenizer.json`, only llama.cpp metadata (`tokenizer.ggml.*`). transformers can
build a tokenizer from it, but its GGUF reader imports torch. For byte-level BPE vocabularies
(`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, ...) we build the same `tokenizers` object
here from the GGUF metadata (`loading/gguf_file.py`), mirroring transformers' GGUF conversion
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`: `byte_level_tokenizer`,
`add_gguf_special_tokens`, `set_split_regex`, on top of `GPT2Tokenizer`), and serve encode, decode
and the chat template from it directly (`GGUFTokenizer`), the rest of transformers' interface
through the equivalent `PreTrainedTokenizerFast`, built when first asked for. tests/test_tokenizer.py
checks it is token-identical to transformers' own.
Other vocabulary types (sentencepiece `llama`, ...) still go through transformers, which needs torch.
"""
from __future__ import annotations

import functools
import os

from hsd_jax.loading.errors import ModelLoadError, reading
from hsd_jax.loading.gguf_file import read_gguf

# llama.cpp token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` names whose merges were learned on another split than GPT-2's regex, as in
# transformers' GGUF_PRE_TOKENIZER_SPLITS (a test keeps the two equal); any other name (`smollm`,
# `gpt2`, `default`, ...) keeps GPT-2's byte-level regex, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


def load_tokenizer(path: str):
    """A tokenizer with transformers' interface; `path` is a .gguf file or a model directory. Never
    touches a hub and never imports torch for a byte-level BPE GGUF or a HF directory."""
    with reading(path, "cannot load a tokenizer"):
        if path.endswith(".gguf"):
            return gguf_tokenizer(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def gguf_tokenizer(path: str):
    """The tokenizer a GGUF's metadata describes: a `GGUFTokenizer` for byte-level BPE, else
    transformers' own."""
    _field = read_gguf(path).fields.get
    kind = _field("tokenizer.ggml.model")
    if kind != "gpt2":
        return _transformers_gguf_tokenizer(path, kind)
    tokens = _field("tokenizer.ggml.tokens")
    merges = _field("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ModelLoadError(f"{path}: no tokenizer.ggml.tokens / merges in the metadata")
    return build_byte_level_tokenizer(
        tokens, merges, token_types=_field("tokenizer.ggml.token_type"),
        pre=_field("tokenizer.ggml.pre"),
        special_ids={name: _field(f"tokenizer.ggml.{key}") for name, key in
                     (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))},
        chat_template=_field("tokenizer.chat_template"),
        add_bos_token=bool(_field("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(_field("tokenizer.ggml.add_eos_token", False)),
        name_or_path=os.path.dirname(path))


def build_byte_level_tokenizer(tokens, merges, *, token_types=None, pre=None, special_ids=None,
                               chat_template=None, add_bos_token=False, add_eos_token=False,
                               name_or_path=""):
    """Byte-level BPE from a GGUF vocabulary, as transformers' GGUF conversion builds it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # a token spelled outside the byte alphabet is respelled from its UTF-8 bytes
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    types = list(token_types) if token_types is not None else []
    # CONTROL tokens (<|im_start|>, ...) are special and matched whole; a control token spelled
    # outside the byte alphabet is a llama.cpp mislabel and skipped. USER_DEFINED: added, not special.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab])
    specials = {name: tokens[int(i)] for name, i in (special_ids or {}).items()
                if i is not None and 0 <= int(i) < len(tokens)}
    return GGUFTokenizer(backend, chat_template=chat_template, specials=specials, add_bos_token=add_bos_token,
                         add_eos_token=add_eos_token, name_or_path=name_or_path)


class GGUFTokenizer:
    """A GGUF's byte-level BPE tokenizer that encodes, decodes and renders its chat template on the
    `tokenizers` backend itself, so a process that only serves never imports transformers (~1.3 s of
    every start). Everything else (`__call__`, special-token tables, `save_pretrained`, ...) is the
    equivalent `PreTrainedTokenizerFast` (`.hf`, built on first such use); tests/test_tokenizer.py
    checks the two agree on every method here."""

    def __init__(self, backend, *, chat_template, specials: dict, add_bos_token: bool, add_eos_token: bool,
                 name_or_path: str):
        from tokenizers import Tokenizer

        self._hf_args = dict(tokenizer_object=Tokenizer.from_str(backend.to_str()), chat_template=chat_template,
                             add_bos_token=add_bos_token, add_eos_token=add_eos_token,
                             clean_up_tokenization_spaces=False, name_or_path=name_or_path, **specials)
        self._hf = None
        self.chat_template = chat_template
        self._specials = dict(specials)
        self._backend = backend
        _add_bos_eos(backend, specials, add_bos_token, add_eos_token)

    @property
    def hf(self):
        """The same tokenizer as a transformers `PreTrainedTokenizerFast`."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(**self._hf_args)
        return self._hf

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.hf)

    @property
    def bos_token(self) -> str | None:
        return self._specials.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._specials.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs):
        template = _compiled_template(self.chat_template) if self.chat_template and not tokenize and not kwargs else None
        if template is None:
            return self.hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                               tokenize=tokenize, **kwargs)
        return template.render(messages=conversation, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self._specials)


def _add_bos_eos(backend, specials: dict, add_bos: bool, add_eos: bool) -> None:
    """The post-processor `PreTrainedTokenizerFast(add_bos_token=, add_eos_token=)` sets."""
    from tokenizers import processors

    bos, eos = specials.get("bos_token"), specials.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    tokens = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled as transformers compiles it (sandboxed, blocks trimmed, `tojson`,
    `raise_exception`, `strftime_now`); None for one that needs transformers' own extensions
    (`{% generation %}` blocks), which then renders through `.hf`."""
    import datetime
    import json

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError:
        return None


def _transformers_gguf_tokenizer(path: str, kind):
    """Vocabulary types not rebuilt here go through transformers' GGUF path, which imports torch."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ModelLoadError(f"{path}: tokenizer type {kind!r} is only readable through transformers' GGUF "
                             "support, which needs torch; byte-level BPE ('gpt2') GGUFs and HF directories "
                             "load without it")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)
