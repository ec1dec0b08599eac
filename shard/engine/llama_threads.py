"""The compute threads of a llama.cpp context: one ggml thread pool per context, created at load
and freed after the context, whose threads sleep between steps.

Why: with llama.cpp built against OpenMP, libgomp's threads spin after every step and at every
ggml barrier. A worker alone on its cores hardly notices, but every other process on the box
does: in a two-worker pipeline on two cores the idle worker's spinning team took the cores the
busy one computed on. The project builds llama.cpp without OpenMP (``shard.llama_build``), so
ggml runs its own pool; with no pool attached it would create and join a pool per graph whose
threads poll for work (polling level 50), which was even worse. This pool is created once,
with polling level 0: its threads wait on a condition variable between graphs and spin only
inside one (ggml's barriers). A two-worker pipeline, and any worker next to a busy process, is
faster on it than on OpenMP's team, one worker alone the same (docs/engine.md, "Compute
threads"; the figures in docs/benchmarks.md, bench/engine/colocated.py).

One of the modules allowed to use ``ctypes`` and ``llama_cpp`` (tests/test_import_boundary.py):
llama-cpp-python binds neither the pool functions (libggml-base, libggml-cpu) nor
``llama_attach_threadpool`` (libllama); all three libraries sit in llama_cpp's ``lib/``
directory (or its ``LLAMA_CPP_LIB_PATH``), already loaded: ``load_library`` opens the very
files libllama mapped, so ``CDLL`` returns the same handles. With a single thread no pool is
made: ggml then computes on the calling thread.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as lc

from .errors import EngineFailure

GGML_MAX_N_THREADS = 512  # ggml.h
#: ggml's polling level for idle pool threads (0: wait on a condition variable at once, 100:
#: spin about 13 million rounds first).
POLL_LEVEL = 0


class _PoolParams(ctypes.Structure):
    """``struct ggml_threadpool_params`` (ggml.h)."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),  # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


@dataclass(frozen=True)
class _PoolApi:
    params_init: Any  # void ggml_threadpool_params_init(struct ggml_threadpool_params *, int)
    new: Any  # struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params *)
    free: Any  # void ggml_threadpool_free(struct ggml_threadpool *)
    attach: Any  # void llama_attach_threadpool(llama_context *, ggml_threadpool_t, ggml_threadpool_t)


_api: _PoolApi | None = None
_api_lock = threading.Lock()


def native_library_dir() -> Path:
    """Where llama_cpp loaded libllama from, found as llama_cpp finds it (its
    ``LLAMA_CPP_LIB_PATH`` override, else its package's ``lib/``): ggml's functions must come
    from the very libraries the context runs on."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    return Path(override) if override else Path(lc.__file__).parent / "lib"


def _loaded(lib_dir: Path, stem: str) -> Path | None:
    """The file of ``lib<stem>`` that this process already mapped from ``lib_dir``. The wheel
    ships ``libggml-cpu.so`` and ``libggml-cpu.so.0`` as separate copies; libllama loaded the
    second (its soname), and opening the first would map a second ggml whose private state was
    never initialised."""
    try:
        with open("/proc/self/maps") as maps:
            fields = (line.split(None, 5) for line in maps)
            paths = {f[5].strip() for f in fields if len(f) == 6}  # anonymous maps name no file
    except OSError:  # pragma: no cover - no /proc
        return None
    lib_dir = lib_dir.resolve()
    for raw in sorted(paths):
        path = Path(raw)
        if path.parent == lib_dir and path.name.startswith(f"lib{stem}.so"):
            return path
    return None


def load_library(lib_dir: Path, stem: str) -> ctypes.CDLL:
    """``lib<stem>`` from ``lib_dir``: the very copy already loaded when there is one (``CDLL``
    then returns its handle), else the first file of that name."""
    found = _loaded(lib_dir, stem)
    if found is None:
        candidates = sorted(lib_dir.glob(f"lib{stem}.*")) or sorted(lib_dir.glob(f"{stem}.*"))
        if not candidates:
            raise EngineFailure(f"lib{stem} not found in {lib_dir}: cannot reach llama.cpp's ggml")
        found = candidates[0]
    return ctypes.CDLL(str(found))


def _pool_api() -> _PoolApi:
    """Resolve the pool functions once per process (EngineFailure when a library is missing)."""
    global _api
    with _api_lock:
        if _api is None:
            _api = _declare(_resolve(native_library_dir()))
        return _api


def _resolve(lib_dir: Path) -> _PoolApi:
    """The four functions from ``lib_dir``'s libraries (EngineFailure when any is missing)."""
    try:
        base, cpu = load_library(lib_dir, "ggml-base"), load_library(lib_dir, "ggml-cpu")
        llama = load_library(lib_dir, "llama")  # llama-cpp-python does not bind the attach call
        return _PoolApi(base.ggml_threadpool_params_init, cpu.ggml_threadpool_new,
                        cpu.ggml_threadpool_free, llama.llama_attach_threadpool)
    except (OSError, AttributeError) as exc:  # a library that will not load, a missing symbol
        raise EngineFailure(
            f"llama.cpp's thread pool functions are not available in {lib_dir}: {exc}"
        ) from None


def _declare(api: _PoolApi) -> _PoolApi:
    """Give the functions their C signatures (ctypes would pass and return ints otherwise)."""
    api.params_init.argtypes = [ctypes.POINTER(_PoolParams), ctypes.c_int]
    api.params_init.restype = None
    api.new.argtypes = [ctypes.POINTER(_PoolParams)]
    api.new.restype = ctypes.c_void_p
    api.free.argtypes = [ctypes.c_void_p]
    api.free.restype = None
    api.attach.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    api.attach.restype = None
    return api


class ComputeThreads:
    """The ggml thread pool of one context. ``attach`` once the context exists; ``close`` only
    after the context was freed (the context computes on the pool until then)."""

    def __init__(self, n_threads: int, *, poll: int = POLL_LEVEL) -> None:
        if n_threads < 2:
            raise ValueError("a pool needs at least two threads (one computes on the caller)")
        api = _pool_api()
        params = _PoolParams()
        api.params_init(ctypes.byref(params), n_threads)
        params.poll = poll
        handle = api.new(ctypes.byref(params))
        if not handle:
            raise EngineFailure(f"ggml could not create a pool of {n_threads} threads")
        self._api, self._handle = api, handle
        self.n_threads, self.poll = n_threads, poll

    @property
    def open(self) -> bool:
        return self._handle is not None

    def attach(self, ctx: int) -> None:
        """Make ``ctx`` compute single-token steps and batches on this pool."""
        if self._handle is None:
            raise EngineFailure("the compute threads were already freed")
        self._api.attach(ctx, self._handle, self._handle)

    def close(self) -> None:
        """Stop and join the pool's threads (idempotent)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._api.free(handle)


__all__ = ["POLL_LEVEL", "ComputeThreads", "load_library", "native_library_dir"]
