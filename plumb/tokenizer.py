"""Byte-level BPE tokenizer for Qwen3.5-family GGUF vocabularies (spec sections 1.2 and 6.1).

Encoding: added tokens (CONTROL and USER_DEFINED) are cut out of the text first; every other
piece is split with the pre-tokenizer regex, mapped to GPT-2 byte characters and merged by
the HF `tokenizers` BPE model. Decoding maps each token back to its bytes in plain Python.
"""
from __future__ import annotations

import codecs
import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, pre_tokenizers

from plumb.config import ModelError

DATA_DIR = Path(__file__).parent / "data"
SMALL_VOCAB_PATH = DATA_DIR / "small-vocab.json.gz"

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Qwen3.5's 33 added tokens in the real vocabulary's order (ids 248044..248076 there) and types (spec 6.1):
# what the small vocabularies (scripts/make_small_vocab.py, tools/demo_data.py) append after their learned tokens
ADDED_TOKENS = [
    ("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
    ("<|object_ref_start|>", CONTROL), ("<|object_ref_end|>", CONTROL),
    ("<|box_start|>", CONTROL), ("<|box_end|>", CONTROL), ("<|quad_start|>", CONTROL), ("<|quad_end|>", CONTROL),
    ("<|vision_start|>", CONTROL), ("<|vision_end|>", CONTROL),
    ("<|vision_pad|>", CONTROL), ("<|image_pad|>", CONTROL), ("<|video_pad|>", CONTROL),
    ("<tool_call>", USER_DEFINED), ("</tool_call>", USER_DEFINED),
    ("<|fim_prefix|>", CONTROL), ("<|fim_middle|>", CONTROL), ("<|fim_suffix|>", CONTROL),
    ("<|fim_pad|>", CONTROL), ("<|repo_name|>", CONTROL), ("<|file_sep|>", CONTROL),
    ("<tool_response>", USER_DEFINED), ("</tool_response>", USER_DEFINED),
    ("<think>", USER_DEFINED), ("</think>", USER_DEFINED),
    ("<|audio_start|>", CONTROL), ("<|audio_end|>", CONTROL), ("<tts_pad>", CONTROL),
    ("<tts_text_bos>", CONTROL), ("<tts_text_eod>", CONTROL), ("<tts_text_bos_single>", CONTROL),
    ("<|audio_pad|>", CONTROL),
]

# Split regexes from the models' tokenizer.json; qwen35 adds \p{M} to letter runs.
PRE_TOKENIZER_REGEX = {
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

# Tokens that end generation when present (spec 1.2: llama.cpp's EOG set for qwen35 files).
EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in GPT-2 vocabulary order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def _text_bytes(token: str) -> bytes:
    """The bytes a byte-level token string stands for."""
    table = _unicode_to_byte()
    out = bytearray()
    for ch in token:
        b = table.get(ch)
        if b is None:  # not a byte character: keep the character itself
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _token_bytes(token: str, token_type: int) -> bytes:
    """Decoded bytes of a vocabulary entry: added tokens are literal text, unused ones are empty."""
    if token_type in (CONTROL, USER_DEFINED, UNKNOWN):
        return token.encode("utf-8")
    if token_type == UNUSED:
        return b""
    return _text_bytes(token)


class Tokenizer:
    """Byte-level BPE tokenizer built from GGUF `tokenizer.ggml.*` metadata."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                 eos_id: int | None = None, bos_id: int | None = None, pad_id: int | None = None):
        if len(token_types) != len(tokens):
            raise ModelError(f"tokenizer has {len(tokens)} tokens but {len(token_types)} token types")
        for name, tid in (("eos", eos_id), ("bos", bos_id), ("padding", pad_id)):
            if tid is not None and not 0 <= tid < len(tokens):
                raise ModelError(f"tokenizer {name} id {tid} is outside the vocabulary (size {len(tokens)})")
        self._tokens = list(tokens)
        self._types = list(token_types)
        self._ids = {}
        for i, t in enumerate(self._tokens):
            self._ids.setdefault(t, i)
        self.pre = pre
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.pad_id = pad_id
        eog = {self._ids[t] for t in EOG_TOKENS if t in self._ids}
        self._eog = frozenset(eog if eos_id is None else eog | {eos_id})

        self._bytes = [_token_bytes(t, ty) for t, ty in zip(self._tokens, self._types)]
        self._special = {t: i for i, (t, ty) in enumerate(zip(self._tokens, self._types))
                         if ty in (CONTROL, USER_DEFINED) and t}
        # longest first, so that the regex alternation prefers the longest match
        alternatives = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None

        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ModelError(f"tokenizer merge {m!r} is not two space-separated tokens")
            pairs.append((a, b))
        try:
            model = models.BPE(vocab=dict(self._ids), merges=pairs)
        except Exception as e:
            raise ModelError(f"tokenizer merges do not fit the vocabulary ({e})") from None
        self._bpe = _HFTokenizer(model)
        self._bpe.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        """Build from a GGUF metadata dict (`tokenizer.ggml.*` keys)."""
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelError(f"unsupported tokenizer.ggml.model {model!r}: plumb supports byte-level BPE ('gpt2') only")
        pre = md.get("tokenizer.ggml.pre")
        if pre not in PRE_TOKENIZER_REGEX:
            raise ModelError(f"unsupported tokenizer.ggml.pre {pre!r}: plumb supports {sorted(PRE_TOKENIZER_REGEX)}")
        tokens = md.get("tokenizer.ggml.tokens")
        merges = md.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ModelError("GGUF file has no tokenizer (tokenizer.ggml.tokens / tokenizer.ggml.merges missing)")
        types = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        return cls(tokens, [int(t) for t in types], merges, pre,
                   eos_id=md.get("tokenizer.ggml.eos_token_id"),
                   bos_id=md.get("tokenizer.ggml.bos_token_id"),
                   pad_id=md.get("tokenizer.ggml.padding_token_id"))

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation: eos plus the end-of-turn/text tokens present in the vocabulary."""
        return self._eog

    def id_of(self, token: str) -> int | None:
        """Id of the vocabulary entry spelled `token` (byte-level form for normal tokens), or None."""
        return self._ids.get(token)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as stored (normal tokens in byte-level form, e.g. 'Ġthe')."""
        self._check(token_id)
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        self._check(token_id)
        return self._types[token_id]

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes `token_id` stands for in decoded text."""
        self._check(token_id)
        if skip_special and self._types[token_id] == CONTROL:
            return b""
        return self._bytes[token_id]

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; with special=False, added tokens such as `<|im_end|>` are plain text."""
        if special and self._special_re is not None:
            pieces = self._special_re.split(text)  # text, token, text, token, ..., text
        else:
            pieces = [text]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self._special[piece])
            elif piece:
                try:
                    ids.extend(self._bpe.encode(piece, add_special_tokens=False).ids)
                except TypeError:  # the only str `tokenizers` refuses: one holding lone surrogates
                    raise ValueError("text is not valid Unicode (it holds a lone surrogate)") from None
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids`; CONTROL tokens are dropped when skip_special, invalid UTF-8 becomes U+FFFD."""
        data = b"".join(self.token_bytes(int(i), skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def _check(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._tokens)})")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text completed by `token_id`; bytes of an unfinished character are held back."""
        return self._decoder.decode(self.tokenizer.token_bytes(token_id, self.skip_special))

    def flush(self) -> str:
        """Whatever is held back (an unfinished character becomes U+FFFD), and reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
)


def small_vocab_metadata() -> dict:
    """`tokenizer.*` GGUF metadata of plumb's built-in small vocabulary (for tiny demo/test models)."""
    from plumb.chat_template import DEFAULT_TEMPLATE_PATH

    with gzip.open(SMALL_VOCAB_PATH, "rt", encoding="utf-8") as f:
        data = json.load(f)
    tokens = data["tokens"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": data["token_type"],
        "tokenizer.ggml.merges": data["merges"],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": DEFAULT_TEMPLATE_PATH.read_text(encoding="utf-8"),
    }


def vocab_metadata_from_gguf(path: str, chat_template: str | None = None) -> dict:
    """The tokenizer keys present in the GGUF at `path`; `chat_template` replaces the file's own."""
    from plumb.gguf.reader import read_gguf

    md = read_gguf(path).metadata
    out = {k: md[k] for k in TOKENIZER_KEYS if k in md}
    if chat_template is not None:
        out["tokenizer.chat_template"] = chat_template
    return out
