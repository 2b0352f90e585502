"""Content addressing: every blob of a save is cut into CHUNK_SIZE (2 MiB) pieces
named by xxh3-128, so a store that already has a chunk is never sent it again."""

from __future__ import annotations

import xxhash

from ..protocol import CHUNK_SIZE


def chunk_blob(data, chunks: dict[str, memoryview]) -> dict:
    """Cut ``data`` into CHUNK_SIZE pieces; register each by hash; return a Blob."""
    mv = memoryview(data).cast("B")
    names = []
    for off in range(0, len(mv), CHUNK_SIZE):
        piece = mv[off : off + CHUNK_SIZE]
        h = xxhash.xxh3_128_hexdigest(piece)
        chunks.setdefault(h, piece)
        names.append(h)
    return {"len": len(mv), "chunks": names}
