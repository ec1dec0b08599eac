"""What a benchmark's numbers depend on, recorded next to them.

Absolute speeds differ by about 3x between machines of the same kind (and move with the load of
a shared machine), so every result file carries the model's digest, the library versions, how
llama.cpp was built and what it reports about the CPU, the thread count, the exact command and
the load average before and after the run. Only ratios measured in one run are comparable.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def llama_system_info() -> str:
    """llama.cpp's own line: SIMD features it was compiled with and uses (AVX2, AMX, ...)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return (info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)).strip()


def llama_build() -> dict[str, Any] | None:
    """Which llama.cpp build profile is installed (profile name, cmake args), if recorded.

    ``shard.llama_build`` is written by the install step; older trees do not have it.
    """
    try:
        from shard.llama_build import installed_build  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return installed_build()
    except Exception as exc:  # noqa: BLE001 - a broken record must not stop a benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}


def default_threads() -> int:
    """What ``trio-shard serve`` uses without ``--threads``: half the usable cores, at most 8."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        usable = os.cpu_count() or 1
    return max(1, min(usable // 2, 8))


def environment(model: Path | None, threads: int, *, argv: list[str] | None = None) -> dict[str, Any]:
    """The environment record written into every result file (``model`` None: a fake engine's
    bench, no model file)."""
    import llama_cpp

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        affinity = os.cpu_count() or 1
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": shlex.join([Path(sys.executable).name, *(argv if argv is not None else sys.argv)]),
        "model": str(model) if model is not None else None,
        "model_bytes": model.stat().st_size if model is not None else None,
        "model_sha256": sha256_file(model) if model is not None else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": affinity,
        "threads": threads,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_system_info(),
        "llama_cpp_build": llama_build(),
        "load_average_before": load_average(),
        "source": source_revision(),
    }


def save_record(out: Path, record: dict[str, Any]) -> None:
    """Write a bench's result file (its folder made first), then print its results."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record.get("results", record), indent=1))


def source_revision() -> str | None:
    """The checkout's commit (``-dirty`` with uncommitted changes), or None outside git."""
    root = Path(__file__).resolve().parents[2]  # the checkout (bench/common/ is two below)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def save_chart(fig: Any, ax: Any, path: Path, title: str) -> None:
    """Title, grid and legend as every bench chart has them, then write ``path`` and close."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
