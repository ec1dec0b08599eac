"""Process-wide llama.cpp setup: the log callback and backend init, the calls made per step with
the GIL held, the reason of the last native error, and what native code runs.

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py).

Logging: llama.cpp logs to stderr unless a callback is set; llama-cpp-python installs one that
prints. Ours forwards to Python logging at DEBUG and remembers recent error lines so a failed
load can say why. The callback is process-global in llama.cpp, so it is installed once and kept
referenced by this module for the life of the process.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as lc

from shard.llama_build import installed_build

from .errors import InvalidInput

native_log = logging.getLogger("shard.engine.llama.native")

#: llama.cpp's compile-time limit on sequence ids per context (``LLAMA_MAX_SEQ``).
LLAMA_MAX_SEQ = 256
LLAMA_TOKEN_NULL = -1
_GGUF_MAGIC = b"GGUF"

# ggml_log_level as the library really uses it (llama-cpp-python's _logger comment is off by
# one): 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT.
_GGML_LOG_LEVEL_ERROR = 4
_GGML_LOG_LEVEL_CONT = 5
_recent_errors: collections.deque[str] = collections.deque(maxlen=8)
_log_state = {"last_level": 1}
_init_lock = threading.Lock()
_initialized = False


def _on_native_log(level: int, text: bytes | None, _user_data: int | None) -> None:
    try:  # an exception must never escape into C
        if level == _GGML_LOG_LEVEL_CONT:  # continuation of the previous message
            level = _log_state["last_level"]
        else:
            _log_state["last_level"] = level
        msg = (text or b"").decode("utf-8", "replace").rstrip("\n")
        if msg and level == _GGML_LOG_LEVEL_ERROR:
            _recent_errors.append(msg.strip())
        if msg and native_log.isEnabledFor(logging.DEBUG):
            native_log.debug("%s", msg)
    except Exception:  # noqa: BLE001 - nothing can be reported from inside a C callback
        pass


_LOG_CALLBACK = lc.llama_log_callback(_on_native_log)


def ensure_native_init() -> None:
    """Install the log callback and initialise the backend once per process."""
    global _initialized
    with _init_lock:
        if not _initialized:
            lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _initialized = True


def clear_native_errors() -> None:
    """Forget the native errors logged so far (before an operation whose failure is reported)."""
    _recent_errors.clear()


def native_reason() -> str:
    """The first native error logged since the last clear: usually the most specific one."""
    return f" (llama.cpp: {_recent_errors[0]})" if _recent_errors else ""


class _GilHeldCalls:
    """The tiny llama.cpp calls made per step, bound through ``ctypes.PyDLL`` so they keep the
    GIL. ``ctypes.CDLL`` (llama-cpp-python's binding) releases the GIL around every call, and
    taking it back waits while the other thread runs Python (up to the switch interval): with
    a dozen such calls per step, those waits cost more than the calls (bench/worker/profile_server.py).
    Each of these returns in microseconds and never calls back into Python."""

    def __init__(self) -> None:
        lib = ctypes.PyDLL(lc._lib._name, handle=lc._lib._handle)
        for name in (
            "llama_memory_seq_pos_max", "llama_memory_seq_pos_min", "llama_memory_seq_rm",
            "llama_get_logits_ith", "llama_vocab_is_eog", "llama_token_to_piece",
        ):
            fn, declared = getattr(lib, name), getattr(lc, name)
            fn.argtypes, fn.restype = declared.argtypes, declared.restype
            setattr(self, name, fn)


#: The one set of GIL-held calls; looked up by attribute at every call (tests replace one).
held: Any = _GilHeldCalls()


def native_system_info(*, use_extra_bufts: bool = True, threads: int | None = None) -> str:
    """One line naming the native code that runs: the llama-cpp-python version, the build profile
    it was installed with (``shard.llama_build``), whether extra buffer types (repacked / AMX
    weight layouts) are used, how many threads compute (``threads``, when known: more than one
    run on the context's ggml pool, ``shard.engine.llama_threads``), and llama.cpp's system info
    (the CPU features it was compiled for).
    """
    build = installed_build()
    origin = f"build {build['key']}" if build else "build not recorded (not installed by shard.llama_build)"
    info = " ".join(lc.llama_print_system_info().decode("utf-8", "replace").split())
    bufts = "on" if use_extra_bufts else "off"
    if threads is not None:
        where = "one ggml pool" if threads > 1 else "the native thread"
        bufts += f"; threads {threads} ({where})"
    return f"llama-cpp-python {llama_cpp.__version__}; {origin}; extra bufts {bufts}; {info}"


def default_threads() -> int:
    """Half the usable CPUs (physical cores on SMT machines; llama-cpp-python's default too),
    at most 8. Headroom matters: ggml's threads spin at barriers inside a step, so a busy
    process on the same cores slows a team using every core far more than a smaller one."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    return max(1, min(n // 2, 8))


def check_model_file(model_path: Path | None) -> Path:
    """Refuse a missing, unreadable or non-GGUF file before llama.cpp sees it."""
    if model_path is None:
        raise InvalidInput("the llama.cpp engine needs a model_path")
    path = Path(model_path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise InvalidInput(f"model file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise InvalidInput(f"model path {str(path)!r} is a directory") from None
    except OSError as exc:
        raise InvalidInput(f"model file {str(path)!r} cannot be read: {exc.strerror}") from None
    if magic != _GGUF_MAGIC:
        raise InvalidInput(f"model file {str(path)!r} is not a GGUF file")
    return path


__all__ = [
    "LLAMA_MAX_SEQ", "LLAMA_TOKEN_NULL", "check_model_file", "clear_native_errors", "default_threads",
    "ensure_native_init", "held", "native_reason", "native_system_info",
]
