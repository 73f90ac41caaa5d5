"""Incremental detokenizer: token ids -> text deltas, holding back incomplete UTF-8 at the tail.

Works on the exact token bytes (helios.frontend.tokenizer.token_byte_table), so the text is the decoded
concatenation of the tokens' bytes and never re-decodes a window. Imports no torch and no tokenizer library.
"""

from __future__ import annotations

from collections.abc import Sequence


def complete_prefix_len(buf: bytes | bytearray) -> int:
    """Length of `buf` without a trailing, possibly incomplete UTF-8 sequence (at most 3 bytes held)."""
    n = len(buf)
    for i in range(n - 1, max(n - 4, -1), -1):
        b = buf[i]
        if b & 0xC0 == 0x80:  # continuation byte: look further back for its lead
            continue
        if b >= 0xF0:
            need = 4 if b < 0xF8 else 1
        elif b >= 0xE0:
            need = 3
        elif b >= 0xC0:
            need = 2
        else:
            need = 1
        return i if n - i < need else n
    return n  # only continuation bytes in the window: invalid, let the decoder replace them


class IncrementalDetokenizer:
    """push(token_id) -> newly released text; flush() at the end releases held bytes (with replacement)."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: frozenset[int] = frozenset(),
                 skip_special_tokens: bool = True):
        self._table = token_bytes
        self._special = special_ids
        self._skip_special = skip_special_tokens
        self._held = bytearray()
        self.num_chars = 0  # chars released so far: the text_offset of the next token

    def token_bytes(self, token_id: int) -> bytes:
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def push(self, token_id: int) -> str:
        if self._skip_special and token_id in self._special:
            return ""
        self._held += self.token_bytes(token_id)
        cut = complete_prefix_len(self._held)
        if cut == 0:
            return ""
        text = bytes(self._held[:cut]).decode("utf-8", errors="replace")
        del self._held[:cut]
        self.num_chars += len(text)
        return text

    def flush(self) -> str:
        if not self._held:
            return ""
        text = bytes(self._held).decode("utf-8", errors="replace")
        self._held.clear()
        self.num_chars += len(text)
        return text
