"""core/hashing.py: the one file hash, held against hashlib over the bytes read whole."""

from __future__ import annotations

import hashlib
import os

import pytest

from core.hashing import sha256_file


@pytest.mark.parametrize("size", [0, 1, 65_537, (3 << 20) + 5])   # empty, tiny, past one block, several MiB
def test_sha256_file_equals_the_hash_of_the_bytes(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert sha256_file(str(path)) == hashlib.sha256(data).hexdigest()


def test_sha256_file_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        sha256_file(tmp_path / "nope.bin")
