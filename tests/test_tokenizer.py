"""The embedded GGUF's tokenizer without torch: token-identical to transformers' GGUF tokenizer
(which imports torch, so the comparisons skip without it), and a whole load-generate-decode run
in a process where `import torch` is impossible."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hsd_jax.loading.gguf_loader import default_gguf_path
from hsd_jax.loading.tokenizer import PRE_TOKENIZER_SPLITS, load_tokenizer
from hsd_jax.prompts import DATA_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(name):
    with open(os.path.join(DATA_DIR, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _turns(name):
    return [t for r in _rows(name) for t in r["turns"]]


def _texts():
    """Real prompts (every turn), GSM8K questions and answers, and news articles to summarise."""
    gsm = _rows("gsm8k_train_sample.jsonl")
    return (_turns("spec_bench_question.jsonl") + _turns("eagle_mt_bench.jsonl")
            + [r["question"] for r in gsm] + [r["answer"] for r in gsm]
            + [r["turns"][0] for r in _rows("eagle_sum.jsonl")])


TEXTS = _texts()
NON_ASCII = [t for t in TEXTS if any(ord(c) > 127 for c in t)]


@pytest.fixture(scope="module")
def mine():
    return load_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def ref():
    """transformers' own GGUF tokenizer: its GGUF reader imports torch."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)


def test_corpus_has_non_ascii_and_special_cases():
    assert len(TEXTS) > 1000
    assert len(NON_ASCII) > 100
    # translation prompts with accented Latin, and other scripts beyond Latin-1
    assert any(any(0x80 <= ord(c) < 0x250 for c in t) for t in NON_ASCII)
    assert any(any(ord(c) >= 0x250 for c in t) for t in NON_ASCII)


def test_backend_and_special_tokens_match(mine, ref):
    assert json.loads(mine.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "special_tokens_map", "chat_template", "clean_up_tokenization_spaces"):
        assert getattr(mine, attr) == getattr(ref, attr), attr
    assert mine.eos_token == "<|im_end|>" and mine.eos_token_id == 2
    assert len(mine) == len(ref) == 49152


def test_plain_encode_and_decode_match(mine, ref):
    got = mine(TEXTS)["input_ids"]
    want = ref(TEXTS)["input_ids"]
    bad = [t[:80] for t, a, b in zip(TEXTS, got, want) if a != b]
    assert not bad, f"{len(bad)} texts differ, first: {bad[:3]}"
    for text, ids in zip(TEXTS, got):
        assert mine.decode(ids) == text           # byte-level BPE: lossless
    for ids in got[::7]:
        for skip in (True, False):
            assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_own_encode_decode_and_chat_template_equal_transformers_own(mine):
    """What `GGUFTokenizer` computes itself (serving never imports transformers) equals its
    `PreTrainedTokenizerFast` twin, with and without a BOS/EOS the post-processor adds."""
    from hsd_jax.loading.gguf_file import read_gguf
    from hsd_jax.loading.tokenizer import build_byte_level_tokenizer

    fields = read_gguf(default_gguf_path()).fields
    tokens, merges = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.merges"]
    with_bos = build_byte_level_tokenizer(tokens, merges, token_types=fields["tokenizer.ggml.token_type"],
                                          special_ids={"bos_token": 1, "eos_token": 2}, add_bos_token=True,
                                          add_eos_token=True, chat_template=mine.chat_template)
    for tok in (mine, with_bos):
        for attr in ("bos_token", "eos_token", "bos_token_id", "eos_token_id"):
            assert getattr(tok, attr) == getattr(tok.hf, attr), attr
        for text in TEXTS[::5] + NON_ASCII:
            for special in (True, False):
                ids = tok.encode(text, add_special_tokens=special)
                assert ids == tok.hf.encode(text, add_special_tokens=special), text[:80]
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)
        for messages in _chats()[::3]:
            for prompt in (True, False):
                assert (tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
                        == tok.hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False))
    assert with_bos.encode("Hi")[0] == 1 and with_bos.encode("Hi")[-1] == 2 and mine.encode("Hi")[0] != 1


def test_non_ascii_prompts_match(mine, ref):
    for text in NON_ASCII:
        ids = mine(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text[:80]
        assert mine.decode(ids) == text
        assert mine.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def _chats():
    gsm = _rows("gsm8k_train_sample.jsonl")[:40]
    firsts = [[{"role": "user", "content": t}] for t in
              [r["turns"][0] for r in _rows("spec_bench_question.jsonl") + _rows("eagle_mt_bench.jsonl")]]
    multi = [[{"role": "system", "content": "You answer math questions step by step."},
              {"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]},
              {"role": "user", "content": "Check your answer."}] for r in gsm]
    return firsts + multi


def test_chat_template_encode_matches(mine, ref):
    for messages in _chats():
        text = mine.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = mine(text, add_special_tokens=False)["input_ids"]
        assert ids == ref(text, add_special_tokens=False)["input_ids"]
        assert ids[0] == mine.convert_tokens_to_ids("<|im_start|>") == 1
        assert ids.count(mine.eos_token_id) == len(messages) + (messages[0]["role"] != "system")
        assert mine.decode(ids) == text
        assert mine.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    # the tokenized form apply_chat_template returns itself
    msgs = _chats()[0]
    assert (list(mine.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
            == list(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)))


def test_every_control_token_is_one_id(mine, ref):
    controls = [t.content for t in mine.added_tokens_decoder.values() if t.special]
    assert len(controls) == 17 and controls[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for token in controls:
        text = f"Some code{token}more text {token}\n"
        ids = mine(text)["input_ids"]
        assert ids == ref(text)["input_ids"]
        assert ids.count(mine.convert_tokens_to_ids(token)) == 2


def test_pre_tokenizer_table_matches_transformers():
    table = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    assert PRE_TOKENIZER_SPLITS == table.GGUF_PRE_TOKENIZER_SPLITS


def test_load_generate_decode_without_torch():
    """`import torch` fails in this process: the default target loads, generates and decodes, and
    never imports transformers either."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None          # any `import torch` now raises ImportError
        import hsd_jax
        target = hsd_jax.load_target("smollm2-135m", max_cache_len=128)
        out = hsd_jax.generate(target, ["What is the capital of France?"], chat=True, max_new_tokens=6)
        assert sys.modules["torch"] is None, "something replaced the torch block"
        assert "transformers" not in sys.modules, "serving imported transformers (~1.3 s of every start)"
        print(repr(out[0].text))
        assert out[0].text.strip(), out[0].text
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
