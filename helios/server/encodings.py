"""Request body Content-Encoding: identity, gzip, deflate (zlib, raw accepted), br and zstd.

Decompression is streaming with an output cap, so a compression bomb stops at `limit + 1` bytes and
never allocates its full size. Raises ApiError 413 (over the limit), 415 (unknown coding) or 400 (corrupt).
Blocking CPU work: the app runs it on the frontend worker pool. No torch.
"""

from __future__ import annotations

import io
import zlib

import brotli
import zstandard

from helios.server.errors import ApiError, bad_request, too_large, unsupported_encoding

CHUNK = 1 << 16
SUPPORTED = ("identity", "gzip", "x-gzip", "deflate", "br", "zstd")


def parse_encodings(header: str | None) -> list[str]:
    """Codings in the order they were applied; raises 415 for an unknown one."""
    if not header:
        return []
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    for c in codings:
        if c not in SUPPORTED:
            raise unsupported_encoding(c)
    return [c for c in codings if c != "identity"]


def _zlib(data: bytes, wbits: int, limit: int) -> bytes:
    d = zlib.decompressobj(wbits)
    out = bytearray()
    buf = data
    while True:
        out += d.decompress(buf, limit + 1 - len(out))
        if len(out) > limit:
            raise too_large(limit, decoded=True)
        buf = d.unconsumed_tail
        if not buf:
            break
    out += d.flush()
    if len(out) > limit:
        raise too_large(limit, decoded=True)
    if not d.eof:
        raise bad_request(f"truncated compressed body (wbits {wbits})")
    return bytes(out)


def _deflate(data: bytes, limit: int) -> bytes:
    try:
        return _zlib(data, zlib.MAX_WBITS, limit)
    except zlib.error:
        return _zlib(data, -zlib.MAX_WBITS, limit)  # raw deflate, as some clients send


def _brotli(data: bytes, limit: int) -> bytes:
    d = brotli.Decompressor()
    out = bytearray(d.process(data, output_buffer_limit=CHUNK))
    while not d.is_finished():
        if len(out) > limit:
            raise too_large(limit, decoded=True)
        piece = d.process(b"", output_buffer_limit=CHUNK)
        if not piece:
            break
        out += piece
    if len(out) > limit:
        raise too_large(limit, decoded=True)
    if not d.is_finished():
        raise bad_request("truncated brotli body")
    return bytes(out)


def _zstd(data: bytes, limit: int) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    out = bytearray()
    while piece := reader.read(CHUNK):
        out += piece
        if len(out) > limit:
            raise too_large(limit, decoded=True)
    return bytes(out)


def decode_body(data: bytes, codings: list[str], limit: int) -> bytes:
    """Undo the codings (last applied first), each bounded by `limit` decoded bytes."""
    for coding in reversed(codings):
        try:
            if coding in ("gzip", "x-gzip"):
                data = _zlib(data, 16 + zlib.MAX_WBITS, limit)
            elif coding == "deflate":
                data = _deflate(data, limit)
            elif coding == "br":
                data = _brotli(data, limit)
            else:
                data = _zstd(data, limit)
        except ApiError:
            raise
        except (zlib.error, brotli.error, zstandard.ZstdError) as e:
            raise bad_request(f"the request body is not valid {coding}: {e}") from None
    return data
