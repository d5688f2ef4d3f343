"""KeyHasher, the per-request key digest, is HMAC-SHA256 exactly: keys stored by ``hash_key`` (the admin
API, ``python -m plugins.tenancy``, configs written before it) must keep matching."""

from __future__ import annotations

import hmac

from hypothesis import given
from hypothesis import strategies as st

from plugins.tenancy.keys import KeyHasher, hash_key, new_key


@given(pepper=st.binary(max_size=200), key=st.text(max_size=100))
def test_the_digest_is_hash_key_for_any_pepper_and_key(pepper: bytes, key: str) -> None:
    assert KeyHasher(pepper)(key) == hash_key(key, pepper)


def test_peppers_at_and_around_the_block_size_and_reuse() -> None:
    for size in (0, 1, 63, 64, 65, 128, 1000):
        pepper = bytes(range(256))[:size] * (1 + size // 256)
        hasher = KeyHasher(pepper[:size])
        for _ in range(3):  # the keyed states are copied, never consumed
            key = new_key()
            assert hasher(key) == hmac.digest(pepper[:size], key.encode(), "sha256").hex()


def test_a_lone_surrogate_hashes_as_hash_key_does() -> None:
    assert KeyHasher(b"p")("sk-gw-\udcff") == hash_key("sk-gw-\udcff", b"p")
