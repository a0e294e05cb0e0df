"""A pair's example key: the hash of its final token ids, under which its reference values are cached."""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Sequence

KEY_BYTES = 16


def example_key(prompt_ids: Sequence[int], chosen_ids: Sequence[int], rejected_ids: Sequence[int]) -> bytes:
    """16-byte BLAKE2b digest of the three id sequences; lengths are hashed too so that
    moving a token across the prompt/completion boundary changes the key."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(struct.pack("<3I", len(prompt_ids), len(chosen_ids), len(rejected_ids)))
    for ids in (prompt_ids, chosen_ids, rejected_ids):
        h.update(array("q", ids).tobytes())
    return h.digest()
