"""The core's tokenizer: tokenizer.json (HF tokenizers) plus the manifest's special-token policy.

Owns encoding (the prepared add_bos_token/add_eos_token policy, never the file's post-processor), decoding,
and the exact bytes of every token id (for logprob `bytes` fields and the incremental detokenizer).
Imports no torch; the engine and server never see tokenizer objects, only ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from helios.core.manifest import TokenizerInfo

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable-char -> byte table (the inverse of `bytes_to_unicode`) used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_types(node: dict | None) -> set[str]:
    if not node:
        return set()
    types = {node.get("type", "")}
    for child in node.get("decoders") or []:
        types |= _decoder_types(child)
    return types


def token_byte_table(tok: tokenizers.Tokenizer, size: int) -> tuple[list[bytes], frozenset[int]]:
    """Exact bytes per id (b"" for ids the tokenizer lacks) and the ids of special added tokens.

    Byte-level BPE maps each vocabulary char through the GPT-2 table; SentencePiece-style vocabularies spell a
    space as U+2581 and raw bytes as <0xNN>; added tokens are their literal UTF-8 content.
    """
    spec = json.loads(tok.to_str())
    decoders = _decoder_types(spec.get("decoder"))
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in decoders
    byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in decoders
    table = [b""] * max(size, tok.get_vocab_size(with_added_tokens=True))
    byte_of = gpt2_byte_decoder()
    for piece, idx in tok.get_vocab(with_added_tokens=False).items():
        if byte_level:
            try:
                table[idx] = bytes(byte_of[c] for c in piece)
                continue
            except KeyError:  # a piece outside the byte alphabet: take its text
                pass
        if byte_fallback and (m := _BYTE_TOKEN.match(piece)):
            table[idx] = bytes([int(m.group(1), 16)])
        else:
            table[idx] = piece.replace("\u2581", " ").encode()
    special = set()
    for idx, added in tok.get_added_tokens_decoder().items():
        table[idx] = added.content.encode()
        if added.special:
            special.add(idx)
    return table, frozenset(special)


class Tokenizer:
    """Encode with the core's policy; decode through the exact byte table (so text and logprob bytes agree)."""

    def __init__(self, tok: tokenizers.Tokenizer, info: TokenizerInfo, vocab_size: int):
        self._tok = tok
        self.info = info
        self.vocab_size = vocab_size  # the model's output vocabulary (may exceed the tokenizer's)
        self.token_bytes, self.special_ids = token_byte_table(tok, vocab_size)

    @classmethod
    def from_file(cls, path: Path, info: TokenizerInfo, vocab_size: int) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), info, vocab_size)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.info.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        ids = self.info.eos_token_ids
        return self.id_to_token(ids[0]) if ids else None

    def id_to_token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.token_bytes):
            return None
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its vocabulary from)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. add_special_tokens applies the prepared policy (BOS/EOS), not tokenizer.json's."""
        ids = self._tok.encode(text, add_special_tokens=False).ids if text else []
        if add_special_tokens:
            if self.info.add_bos_token and self.info.bos_token_id is not None:
                ids = [self.info.bos_token_id, *ids]
            if self.info.add_eos_token and self.info.eos_token_ids:
                ids = [*ids, self.info.eos_token_ids[0]]
        return ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """Text -> ids without specials added, and the character offset where each token ends (non-decreasing):
        the tokens wholly inside text[:c] are the first bisect_right(ends, c)."""
        if not text:
            return [], []
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [end for _, end in encoding.offsets]

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        table, special = self.token_bytes, self.special_ids
        return b"".join(
            table[i] for i in ids if 0 <= i < len(table) and not (skip_special_tokens and i in special)
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """One token's own text for logprob `token` fields: replacement chars for partial UTF-8."""
        return self.id_to_token(token_id) or ""
