"""The boundary capture of a non-last llama.cpp shard: the output of its last block, copied out
of a running ``llama_decode`` with ggml's scheduler eval callback (``cb_eval``).

Asked node by node whether we want a node's data, the callback answers yes only for the
slice's last block output ``l_out-{n-1}``, so ggml computes the graph up to it in one piece;
called again once that node is computed, it copies the rows (``ggml_backend_tensor_get``) and
returns false, which stops the graph: the output norm and the LM head never run. All KV writes
happen inside the blocks, before that node. Every builder of the architectures the table
supports names each block's output ``l_out`` (``cb(cur, "l_out", il)``).

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).
llama-cpp-python binds llama.h only; the three ggml calls the capture needs live in
libggml-base, next to libllama (``llama_threads.native_library_dir``; libllama already loaded it, so
``CDLL`` returns the same handle).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as lc
import numpy as np

from .errors import EngineFailure
from .llama_threads import load_library, native_library_dir

_GGML_TYPE_F32 = 0  # enum ggml_type; ``type`` is the first member of struct ggml_tensor


@dataclass(frozen=True)
class GgmlApi:
    get_name: Any  # const char * ggml_get_name(const struct ggml_tensor *)
    nbytes: Any  # size_t ggml_nbytes(const struct ggml_tensor *)
    tensor_get: Any  # void ggml_backend_tensor_get(const struct ggml_tensor *, void *, size_t, size_t)


_api: GgmlApi | None = None
_api_lock = threading.Lock()


def ggml_api() -> GgmlApi:
    """Resolve the ggml functions once per process (EngineFailure when the library is missing)."""
    global _api
    with _api_lock:
        if _api is None:
            _api = _resolve(native_library_dir())
        return _api


def _resolve(lib_dir: Path) -> GgmlApi:
    """The three functions from ``lib_dir``'s libggml-base, with their C signatures; a library
    that will not load or lacks a symbol is an EngineFailure, like a missing one."""
    try:
        lib = load_library(lib_dir, "ggml-base")
        get_name, nbytes, tensor_get = lib.ggml_get_name, lib.ggml_nbytes, lib.ggml_backend_tensor_get
    except (OSError, AttributeError) as exc:
        raise EngineFailure(
            f"ggml's tensor functions are not available in {lib_dir}: {exc} "
            "(cannot capture hidden states)"
        ) from None
    get_name.argtypes = [ctypes.c_void_p]
    get_name.restype = ctypes.c_char_p
    nbytes.argtypes = [ctypes.c_void_p]
    nbytes.restype = ctypes.c_size_t
    tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    tensor_get.restype = None
    return GgmlApi(get_name, nbytes, tensor_get)


class CaptureTarget:
    """Where the callback copies the boundary rows of one ``llama_decode`` (all ubatches)."""

    __slots__ = ("dest", "error", "rows")

    def __init__(self, dest: np.ndarray) -> None:
        self.dest = dest  # C-contiguous float32 [m, n_embd]
        self.rows = 0
        self.error: str | None = None

    def check(self, expected: int) -> None:
        """Raise EngineFailure unless every expected row arrived, of the expected type and size."""
        if self.error is not None or self.rows != expected:
            raise EngineFailure(self.error or f"captured {self.rows} of {expected} boundary rows")


class BoundaryCapture:
    """The eval callback of one loaded non-last shard with ``n_layer`` blocks of width ``n_embd``.

    ``callback`` goes into the context parameters (``cb_eval``); the engine keeps this object
    referenced until the context is freed (a collected ctypes callback would crash). ``begin``
    arms it for one ``llama_decode``; ``end`` disarms it.
    """

    def __init__(self, n_layer: int, n_embd: int) -> None:
        self.api = ggml_api()
        self.name = f"l_out-{n_layer - 1}".encode()
        self.n_embd = n_embd
        self._target: CaptureTarget | None = None
        self.callback = lc.ggml_backend_sched_eval_callback(self._on_eval)

    def begin(self, dest: np.ndarray) -> CaptureTarget:
        self._target = CaptureTarget(dest)
        return self._target

    def end(self) -> None:
        self._target = None

    def _on_eval(self, tensor: int | None, ask: bool, _data: int | None) -> bool:
        """ggml's scheduler eval callback, on its compute thread. Must not raise (an exception
        cannot cross into C): failures are recorded on the target, checked by the caller."""
        target = self._target
        try:
            api = self.api
            if not tensor or api.get_name(tensor) != self.name:
                return False
            if ask:
                return True
            if target is None:
                return False
            nbytes = int(api.nbytes(tensor))
            row = self.n_embd * 4
            rows = nbytes // row
            if (
                ctypes.c_int32.from_address(tensor).value != _GGML_TYPE_F32
                or nbytes % row
                or target.rows + rows > target.dest.shape[0]
            ):
                target.error = f"unexpected boundary tensor ({nbytes} bytes for rows of {self.n_embd} float32)"
                return False
            api.tensor_get(tensor, target.dest.ctypes.data + target.rows * row, 0, nbytes)
            target.rows += rows
        except Exception as exc:  # noqa: BLE001 - reported through the target, checked by the caller
            if target is not None:
                target.error = f"boundary capture failed: {type(exc).__name__}: {exc}"
        return False


__all__ = ["BoundaryCapture", "CaptureTarget", "GgmlApi", "ggml_api"]
