"""SHA-256 fingerprints of model files.

Why here: the fingerprint identifies a model across processes and machines (every shard of one
model reports its source's fingerprint), so the slicer that records it and the engine that
reports it must compute the very same thing.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

_fingerprints: dict[tuple[int, int, int, int], str] = {}
_fingerprint_lock = threading.Lock()


def file_fingerprint(path: Path) -> str:
    """SHA-256 of the file's bytes (hex), cached by (device, inode, size, mtime).

    Hashing a model of a few hundred MB takes a noticeable fraction of a second; a process that
    loads the same file again (tests, engine restarts) pays it once.
    """
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _fingerprint_lock:
        hit = _fingerprints.get(key)
    if hit is not None:
        return hit
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    with _fingerprint_lock:
        _fingerprints[key] = digest
    return digest


__all__ = ["file_fingerprint"]
