"""The chunk plan of a weights upload through a ring of staging buffers: which bytes of which tensor go into which
buffer, in order. Pure (standard library only): helios.runner.upload's torch ring and helios.runner.early_upload's
driver ring, which runs before torch is imported, both follow it.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 256  # bytes: where each tensor starts in a buffer (DMA and memcpy both like aligned starts)


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [start, start + num_bytes) of tensor `index` (in the plan's order) at `offset` of its chunk's buffer."""

    index: int
    start: int
    num_bytes: int
    offset: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One fill of ring buffer `slot` and the copy to the device that follows it."""

    slot: int
    pieces: tuple[Piece, ...]

    @property
    def num_bytes(self) -> int:  # the end of the buffer's used bytes
        last = self.pieces[-1]
        return last.offset + last.num_bytes


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def staged_bytes(sizes: list[int]) -> int:
    """Buffer bytes that hold tensors of `sizes` bytes packed ALIGN-aligned: no ring buffer needs more."""
    return max(ALIGN, sum(_align_up(s) for s in sizes))


def plan_chunks(sizes: list[int], buffer_bytes: int, num_buffers: int) -> list[Chunk]:
    """The chunks that carry tensors of `sizes` bytes (in that order) through a ring of num_buffers buffers of
    buffer_bytes each: chunk k fills slot k % num_buffers. Small tensors pack into one buffer, each starting
    ALIGN-aligned; a tensor that does not fit the rest of the current buffer starts the next one, and one larger than
    a buffer fills whole buffers, its tail leaving room for the tensors after it. Empty tensors get no piece.

    NOTE: a tensor never starts mid-buffer when it spans buffers, so every piece of it begins at a multiple of
    buffer_bytes in the tensor and at offset 0 in its buffer: aligned on both sides of the copy."""
    if buffer_bytes < ALIGN or num_buffers < 1:
        raise ValueError(f"buffer_bytes {buffer_bytes} must be at least {ALIGN} and num_buffers {num_buffers} >= 1")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    cursor = 0

    def close() -> None:
        nonlocal pieces, cursor
        if pieces:
            chunks.append(Chunk(len(chunks) % num_buffers, tuple(pieces)))
        pieces, cursor = [], 0

    for index, size in enumerate(sizes):
        if size == 0:
            continue
        if _align_up(cursor) + size > buffer_bytes:
            close()
        cursor = _align_up(cursor)
        start = 0
        while start < size:
            num_bytes = min(size - start, buffer_bytes - cursor)
            pieces.append(Piece(index, start, num_bytes, cursor))
            start, cursor = start + num_bytes, cursor + num_bytes
            if cursor == buffer_bytes:
                close()
    close()
    return chunks
