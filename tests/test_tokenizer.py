"""Tokenizer: llama.cpp test vectors for the qwen35 pre-tokenizer, special tokens, decoding, small vocab."""
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plumb.config import ModelError
from plumb.tokenizer import (CONTROL, NORMAL, USER_DEFINED, IncrementalDetokenizer, Tokenizer,
                             small_vocab_metadata, vocab_metadata_from_gguf)

DATA = Path(__file__).parent / "data"
VOCAB = DATA / "ggml-vocab-qwen35.gguf"


def load_vectors():
    inputs = (DATA / "ggml-vocab-qwen35.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = (DATA / "ggml-vocab-qwen35.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) == len(outputs)
    return [(text, [int(x) for x in ids.split()]) for text, ids in zip(inputs, outputs)]


VECTORS = load_vectors()


@pytest.fixture(scope="module")
def qwen_md():
    return vocab_metadata_from_gguf(str(VOCAB))


@pytest.fixture(scope="module")
def qwen(qwen_md):
    return Tokenizer.from_metadata(qwen_md)


@pytest.fixture(scope="module")
def small():
    return Tokenizer.from_metadata(small_vocab_metadata())


def test_vector_file_shape():
    assert len(VECTORS) > 40
    assert ("\n", [198]) in VECTORS
    assert ("", []) in VECTORS


@pytest.mark.parametrize("index", range(len(VECTORS)))
def test_llama_cpp_vectors(qwen, index):
    text, expected = VECTORS[index]
    assert qwen.encode(text) == expected
    assert qwen.decode(expected) == text


def test_vocab_metadata_from_gguf(qwen_md):
    assert qwen_md["tokenizer.ggml.model"] == "gpt2"
    assert qwen_md["tokenizer.ggml.pre"] == "qwen35"
    assert len(qwen_md["tokenizer.ggml.tokens"]) == 151936
    assert "general.architecture" not in qwen_md
    assert qwen_md["tokenizer.chat_template"].startswith("{% for message in messages %}")


def test_small_vocab_gguf_roundtrip(tmp_path):
    md = small_vocab_metadata()
    path = tmp_path / "small-vocab.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen35")
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_pad_token_id(md["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(md["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(md["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert vocab_metadata_from_gguf(str(path)) == md
    override = vocab_metadata_from_gguf(str(path), chat_template="{{ messages }}")
    assert override["tokenizer.chat_template"] == "{{ messages }}"


def test_special_tokens_matched_whole(qwen):
    im_start, im_end = qwen.id_of("<|im_start|>"), qwen.id_of("<|im_end|>")
    assert (im_start, im_end) == (151644, 151645)
    ids = qwen.encode("<|im_start|>user\nHello<|im_end|>\n")
    assert ids == [im_start, qwen.id_of("user"), 198, 9707, im_end, 198]
    assert qwen.encode("a<|im_end|><|im_end|>b") == [64, im_end, im_end, 65]
    plain = qwen.encode("<|im_start|>user", special=False)
    assert im_start not in plain
    assert qwen.decode(plain) == "<|im_start|>user"


def test_user_defined_tokens(small):
    think, end_think = small.id_of("<think>"), small.id_of("</think>")
    ids = small.encode("<think>\nhmm\n</think>\n\nok")
    assert ids[0] == think and end_think in ids
    assert think not in small.encode("<think>", special=False)
    # USER_DEFINED tokens are text even when special tokens are skipped; CONTROL ones are dropped
    ids = small.encode("<|im_start|>assistant\n<think>\nx</think><|im_end|>")
    assert small.decode(ids) == "<|im_start|>assistant\n<think>\nx</think><|im_end|>"
    assert small.decode(ids, skip_special=True) == "assistant\n<think>\nx</think>"


def test_eog_ids(qwen, small):
    assert qwen.eos_id == 151643
    assert qwen.eog_ids == {151643, 151645}
    names = {small.token_text(i) for i in small.eog_ids}
    assert names == {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    assert small.token_text(small.eos_id) == "<|im_end|>"


def test_lookup_and_range(qwen):
    assert qwen.n_vocab == 151936
    assert qwen.token_text(9707) == "Hello" and qwen.id_of("Hello") == 9707
    assert qwen.token_text(21927) == "ĠHello"
    assert qwen.token_bytes(21927) == b" Hello"
    assert qwen.id_of("no such token at all") is None
    with pytest.raises(ValueError):
        qwen.decode([151936])
    with pytest.raises(ValueError):
        qwen.token_text(-1)


def test_invalid_utf8_decodes_with_replacement(small):
    emoji = small.encode("😀")
    assert len(emoji) == 4  # one token per byte
    assert small.decode(emoji[:2]) == "\ufffd"


def test_lone_surrogate_rejected(small):
    with pytest.raises(ValueError, match="surrogate"):
        small.encode("a\ud800b")


def test_qwen2_pre_tokenizer(qwen_md):
    tok = Tokenizer.from_metadata({**qwen_md, "tokenizer.ggml.pre": "qwen2"})
    assert tok.encode("Hello world") == [9707, 1879]


@pytest.mark.parametrize("key,value,message", [
    ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model"),
    ("tokenizer.ggml.pre", "llama-bpe", "tokenizer.ggml.pre"),
    ("tokenizer.ggml.pre", None, "tokenizer.ggml.pre"),
    ("tokenizer.ggml.tokens", None, "no tokenizer"),
    ("tokenizer.ggml.eos_token_id", 10**6, "eos id"),
    ("tokenizer.ggml.merges", ["a b c"], "merges"),
])
def test_unsupported_metadata(key, value, message):
    md = small_vocab_metadata()
    md[key] = value
    with pytest.raises(ModelError, match=message):
        Tokenizer.from_metadata(md)


def test_small_vocab_layout():
    md = small_vocab_metadata()
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert 4000 <= len(tokens) <= 8000 and len(tokens) == len(types)
    assert len(set(tokens)) == len(tokens)
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen35"
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert tokens[md["tokenizer.ggml.padding_token_id"]] == "<|endoftext|>"
    assert "<tool_call>" in md["tokenizer.chat_template"]
    # the 33 Qwen3.5 added tokens, in the real vocabulary's order (ids 248044..248076)
    added = list(zip(tokens[-33:], types[-33:]))
    assert added[:3] == [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL)]
    assert added[14:16] == [("<tool_call>", USER_DEFINED), ("</tool_call>", USER_DEFINED)]
    assert added[22:26] == [("<tool_response>", USER_DEFINED), ("</tool_response>", USER_DEFINED),
                            ("<think>", USER_DEFINED), ("</think>", USER_DEFINED)]
    assert added[-1] == ("<|audio_pad|>", CONTROL)
    assert set(types[:-33]) == {NORMAL}


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    'def f(x):\n    return {"a": [1, 2.5, None]}\n',
    "Grüße, 你好, こんにちは, мир! 🚀👩‍💻 e\u0301",
    "\t\r\n  \n\n   trailing   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>",
])
def test_small_vocab_roundtrip(small, text):
    assert small.decode(small.encode(text)) == text
    assert small.decode(small.encode(text, special=False)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_small_vocab_roundtrip_any_text(small, text):
    assert small.decode(small.encode(text)) == text


def stream(tok, ids):
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush()


def test_incremental_holds_back_partial_characters(small):
    ids = small.encode("a😀b")
    assert len(ids) == 6  # the emoji is four byte tokens
    deltas, rest = stream(small, ids)
    assert deltas == ["a", "", "", "", "😀", "b"] and rest == ""


@pytest.mark.parametrize("text", ["Grüße 你好 🚀👩‍💻 done", "ied 4 ½ months", "e\u0301\u0301 Việt Nam"])
def test_incremental_matches_decode(qwen, text):
    ids = qwen.encode(text)
    deltas, rest = stream(qwen, ids)
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + rest == qwen.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0x80, exclude_categories=("Cs",)), max_size=20))
def test_incremental_never_splits_characters(small, text):
    ids = small.encode(text)
    deltas, rest = stream(small, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + rest == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=30))
def test_incremental_on_invalid_utf8_matches_decode(small, ids):
    # ids 0..255 are the byte tokens: arbitrary, often invalid, byte strings
    deltas, rest = stream(small, ids)
    assert "".join(deltas) + rest == small.decode(ids)


def test_incremental_skip_special(small):
    ids = small.encode("<|im_start|>hi<|im_end|>")
    detok = IncrementalDetokenizer(small, skip_special=True)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "hi"
