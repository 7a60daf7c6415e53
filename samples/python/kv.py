"""The KV cache's deterministic content, as samples/disagg/kv.hpp computes it, vectorized with
numpy: the Python workers compute and check exactly the bytes the C++ workers do."""

import numpy as np

_MASK = (1 << 64) - 1
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def prompt_digest(prompt):
    """FNV-1a of the prompt's bytes (kv.hpp's prompt_digest)."""
    h = 0xCBF29CE484222325
    for c in prompt.encode():
        h = ((h ^ c) * 0x100000001B3) & _MASK
    return h


def _mix_scalar(x):
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK
    x ^= x >> 33
    return x


def _mix(x):
    x = x ^ (x >> _S33)
    x = x * _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


def blocks(digest, layers, count, block_bytes):
    """The KV of a request: `layers` x `count` blocks of `block_bytes`, layer after layer (the
    order in which the prefill worker sends them), as one uint8 array."""
    words = block_bytes // 8
    bases = np.array(
        [_mix_scalar(digest ^ (layer << 40) ^ (block << 8))
         for layer in range(layers) for block in range(count)],
        dtype=np.uint64,
    )
    with np.errstate(over="ignore"):
        kv = _mix(bases[:, None] + np.arange(words, dtype=np.uint64)[None, :])
    return kv.view(np.uint8).reshape(-1)
