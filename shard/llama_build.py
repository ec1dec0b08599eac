"""Which llama.cpp build this machine gets, built on purpose and cached by its flags.

Why this exists: llama-cpp-python ships only a source distribution, and by default its CMake
build compiles llama.cpp with ``-march=native``. On a CPU that *advertises* AMX (an Intel Xeon
under a VM, for example) such a build uses ggml's AMX kernels for large Q8_0 matrix products and
the worker dies with SIGILL on the first long prefill, although cpuid and XCR0 both say AMX is
usable. No runtime check can tell, so the default build leaves AMX (and AVX-512, which not every
x86-64 machine has) out on purpose. Separately, pip caches built wheels by *source*, not by
``CMAKE_ARGS``: a llama-cpp-python wheel built earlier with other flags, by any project on the
machine, would be reused silently. So the project builds the wheel itself, with flags chosen
here, into a cache keyed by those flags, and installs that exact file with pip's cache off.

Profiles (``TRIO_SHARD_LLAMA_BUILD``; default ``portable``, or ``baseline`` where the building
CPU lacks AVX2):

- ``portable``: x86-64 with SSE4.2, AVX, AVX2, FMA, F16C, BMI2 (x86-64-v3); no AVX-512, AVX-VNNI
  or AMX. Runs on every x86-64 CPU of the last decade (Intel Haswell, AMD Zen and later).
- ``baseline``: x86-64 with SSE4.2 only, for older CPUs (slow).
- ``native``: ``-march=native`` (llama.cpp's own default): fastest on the building machine, may
  use AMX or AVX-512 and crash elsewhere or, on some VMs, on the building machine itself.

On other architectures ``portable`` and ``baseline`` mean llama.cpp's generic build
(``GGML_NATIVE=OFF``).

Usage (the Makefile runs it with the virtualenv's interpreter; standard library only, because it
runs before the project is installed)::

    python shard/llama_build.py install     # build or reuse the wheel, install it if needed
    python shard/llama_build.py show        # the plan as JSON: profile, flags, cache key

The installed build is recorded in ``<venv>/share/trio-shard/llama-build.json``;
``installed_build()`` reads it so the engine, ``caps`` and the benchmarks can say which build ran.
``install`` trusts that record only while the installed native libraries are byte-identical to
the recorded wheel's (a later ``pip install`` may have replaced them): otherwise, or when they
are missing, it installs the wheel again.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
#: SHA-256 of llama_cpp_python-0.3.36.tar.gz on PyPI: the install refuses any other source.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
ENV_PROFILE = "TRIO_SHARD_LLAMA_BUILD"
PROFILES = ("portable", "baseline", "native")
#: Bump when the way a wheel is built changes in a way the flags do not show.
RECIPE_VERSION = 1

# Options common to every profile: CPU backend only, no runtime-loaded backends (so no variant
# with AMX can be picked at run time), no multimodal library (the worker never uses it and it
# is a large part of the compile time), and no OpenMP: ggml's own thread pool instead, whose
# threads the engine lets sleep between steps (shard/engine/llama_threads.py; libgomp's spin
# after every step took the cores of every other process on the box).
_COMMON = (
    "-DGGML_BACKEND_DL=OFF",
    "-DGGML_CPU_ALL_VARIANTS=OFF",
    "-DGGML_OPENMP=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
_NO_WIDE = (
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX512_VBMI=OFF",
    "-DGGML_AVX512_VNNI=OFF",
    "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AVX_VNNI=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)
_X86_V3 = ("-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
           "-DGGML_F16C=ON", "-DGGML_BMI2=ON")
_X86_V2 = ("-DGGML_SSE42=ON", "-DGGML_AVX=OFF", "-DGGML_AVX2=OFF", "-DGGML_FMA=OFF",
           "-DGGML_F16C=OFF", "-DGGML_BMI2=OFF")
_V3_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi2"}


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _host_cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_profile() -> str:
    """``portable`` unless this x86-64 CPU cannot run it (no AVX2 & co): then ``baseline``."""
    if _is_x86() and not _V3_FLAGS <= _host_cpu_flags():
        return "baseline"
    return "portable"


def requested_profile() -> str:
    """The profile asked for through ``TRIO_SHARD_LLAMA_BUILD`` (unset or empty: the default)."""
    value = os.environ.get(ENV_PROFILE, "").strip().lower()
    if not value:
        return default_profile()
    if value not in PROFILES:
        raise SystemExit(f"{ENV_PROFILE}={value!r}: choose one of {', '.join(PROFILES)}")
    return value


def cmake_args(profile: str) -> tuple[str, ...]:
    """The exact CMake options a profile builds with (sorted, so the cache key is stable)."""
    if profile == "native":
        args = ("-DGGML_NATIVE=ON",)
    elif not _is_x86():
        args = ("-DGGML_NATIVE=OFF",)
    elif profile == "portable":
        args = ("-DGGML_NATIVE=OFF", *_X86_V3, *_NO_WIDE)
    elif profile == "baseline":
        args = ("-DGGML_NATIVE=OFF", *_X86_V2, *_NO_WIDE)
    else:
        raise ValueError(f"unknown llama.cpp build profile {profile!r}")
    return tuple(sorted((*_COMMON, *args)))


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def plan(profile: str) -> dict[str, object]:
    """Everything the wheel depends on; its hash names the cache entry.

    ``native`` also depends on the building CPU, so its key includes the CPU's flags.
    """
    inputs: dict[str, object] = {
        "recipe": RECIPE_VERSION,
        "package": PACKAGE,
        "version": VERSION,
        "sdist_sha256": SDIST_SHA256,
        "profile": profile,
        "cmake_args": list(cmake_args(profile)),
        "machine": platform.machine(),
        "libc": "-".join(platform.libc_ver()),
        "compiler": _compiler(),
    }
    if profile == "native":
        inputs["host_cpu_flags"] = sorted(_host_cpu_flags())
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return {**inputs, "key": f"{profile}-{key}"}


def cache_root() -> Path:
    """``$TRIO_SHARD_CACHE`` (default ``~/.cache/trio-shard``), shared with the model cache."""
    env = os.environ.get("TRIO_SHARD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "trio-shard"


def record_path(prefix: str | os.PathLike[str] | None = None) -> Path:
    return Path(prefix or sys.prefix) / "share" / "trio-shard" / "llama-build.json"


def installed_build(prefix: str | os.PathLike[str] | None = None) -> dict[str, object] | None:
    """The build record of the llama-cpp-python installed in this environment, or None when it
    was not installed by this module (for example by a plain ``pip install``)."""
    try:
        return json.loads(record_path(prefix).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per cache entry at a time (two ``make`` runs must not race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip(*args: str, env: dict[str, str] | None = None, quiet: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", *args, *(["--quiet"] if quiet else [])]
    subprocess.run(cmd, check=True, env=env)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _sdist() -> Path:
    """The verified source archive, downloaded once into the cache."""
    target = cache_root() / "sdist" / SDIST_NAME
    if target.is_file() and _sha256(target) == SDIST_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"llama_build: downloading {PACKAGE}=={VERSION} source", file=sys.stderr)
        _pip("download", "--no-deps", "--no-binary", PACKAGE, "--no-cache-dir",
             "-d", tmp, f"{PACKAGE}=={VERSION}")
        got = Path(tmp) / SDIST_NAME
        if not got.is_file():
            raise SystemExit(f"llama_build: pip did not produce {SDIST_NAME}")
        digest = _sha256(got)
        if digest != SDIST_SHA256:
            raise SystemExit(f"llama_build: {SDIST_NAME} has sha256 {digest}, expected {SDIST_SHA256}")
        os.replace(got, target)
    return target


def _clean_env(profile: str) -> dict[str, str]:
    """The build environment: our flags only (a CMAKE_ARGS from the caller's shell must not leak
    in), all cores, and no pip cache anywhere."""
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "FORCE_CMAKE")}
    env["CMAKE_ARGS"] = " ".join(cmake_args(profile))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    env["PIP_NO_CACHE_DIR"] = "1"
    return env


def ensure_wheel(profile: str) -> tuple[Path, dict[str, object]]:
    """Return the cached wheel for ``profile``, building it first if missing."""
    info = plan(profile)
    entry = cache_root() / "llama-wheels" / str(info["key"])
    with _locked(entry.with_suffix(".lock")):
        wheels = sorted(entry.glob("*.whl"))
        if wheels:
            return wheels[0], json.loads((entry / "build.json").read_text())
        sdist = _sdist()
        print(f"llama_build: compiling llama.cpp ({profile}: {' '.join(cmake_args(profile))}); "
              "this takes several minutes", file=sys.stderr)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=entry.parent) as tmp:
            out = Path(tmp) / "out"
            # Not quiet: pip's "still running..." lines show that the long compile is alive.
            _pip("wheel", "--no-cache-dir", "--no-deps", "-w", str(out), str(sdist),
                 env=_clean_env(profile), quiet=False)
            built = sorted(out.glob("*.whl"))
            if len(built) != 1:
                raise SystemExit(f"llama_build: expected one wheel, got {[p.name for p in built]}")
            record = {**info, "build_seconds": round(time.monotonic() - started, 1),
                      "wheel": built[0].name}
            (out / "build.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            os.replace(out, entry)
        print(f"llama_build: built in {record['build_seconds']} s -> {entry}", file=sys.stderr)
        return entry / record["wheel"], record  # type: ignore[operator]


def wheel_libraries(wheel: Path) -> dict[str, str]:
    """The native libraries a wheel installs, with the hashes its RECORD lists for them
    (``sha256=<urlsafe base64>``): what ``installed_libraries_match`` compares against."""
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8"))
        return {
            path: digest
            for path, digest, *_ in rows
            if path.startswith("llama_cpp/lib/") and ".so" in path and digest
        }


def file_record_hash(path: Path) -> str:
    """A file's hash in wheel RECORD format."""
    with open(path, "rb") as f:
        raw = hashlib.file_digest(f, "sha256").digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def installed_libraries_match(site_dir: Path, record: dict[str, object]) -> list[str]:
    """Installed native libraries whose bytes differ from the recorded wheel's (empty: all match).

    This is what proves that the llama.cpp in use is the one built with the recorded flags, and
    not a wheel that pip found in some cache or built with other flags later.
    """
    libs = record.get("libraries")
    if not isinstance(libs, dict) or not libs:
        return ["<no libraries recorded>"]
    return [rel for rel, digest in sorted(libs.items())
            if not (site_dir / rel).is_file() or file_record_hash(site_dir / rel) != digest]


def _llama_cpp_importable() -> bool:
    probe = "import llama_cpp.llama_cpp"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def site_dir() -> Path | None:
    """The directory this interpreter imports ``llama_cpp`` from (without importing it), or
    None when it is not installed."""
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def reinstall_reason(
    current: dict[str, object] | None, wanted: dict[str, object], site: Path | None
) -> str | None:
    """Why the installed llama-cpp-python is not the wanted build (None: it is): no record,
    another build recorded, or native libraries missing or not byte-identical to the record."""
    if current is None:
        return "no install record"
    if current.get("key") != wanted["key"]:
        return f"the installed build is {current.get('key')}, not {wanted['key']}"
    if site is None:
        return "llama_cpp is not installed"
    differ = installed_libraries_match(site, current)
    if differ:
        return f"installed native libraries differ from the recorded wheel: {', '.join(differ)}"
    return None


def install(
    profile: str, *, prefix: str | os.PathLike[str] | None = None, site: Path | None = None
) -> dict[str, object]:
    """Install the profile's wheel into this interpreter's environment unless it already is,
    with the very libraries the record lists. ``prefix`` (default ``sys.prefix``) holds the
    record; ``site`` is where ``llama_cpp`` is installed (default: found by import)."""
    current = installed_build(prefix)
    wanted = plan(profile)
    reason = reinstall_reason(current, wanted, site or site_dir())
    if reason is None and _llama_cpp_importable():
        assert current is not None
        return current
    print(f"llama_build: installing ({reason or 'llama_cpp does not import'})", file=sys.stderr)
    wheel, record = ensure_wheel(profile)
    # The exact file, pip's cache off: nothing built elsewhere can stand in for it.
    _pip("install", "--no-cache-dir", "--force-reinstall", "--no-deps", str(wheel))
    _pip("install", "--no-cache-dir", str(wheel))  # its dependencies (numpy, jinja2, ...)
    record = {**record, "libraries": wheel_libraries(wheel)}
    installed = site or site_dir()
    differ = installed_libraries_match(installed, record) if installed else ["llama_cpp"]
    if differ:
        raise SystemExit(f"llama_build: after installing {wheel.name}, these files are not the "
                         f"wheel's: {', '.join(differ)}")
    path = record_path(prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"llama_build: installed {wheel.name} ({record['key']})", file=sys.stderr)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llama_build",
        description=f"Build and install llama-cpp-python with chosen llama.cpp CPU flags "
        f"(profile from ${ENV_PROFILE}: {', '.join(PROFILES)}; default portable).",
    )
    parser.add_argument("command", choices=["install", "show"])
    parser.add_argument("--profile", choices=PROFILES, help=f"override ${ENV_PROFILE}")
    args = parser.parse_args(argv)
    profile = args.profile or requested_profile()
    if args.command == "show":
        print(json.dumps({"plan": plan(profile), "installed": installed_build()}, indent=2))
        return 0
    install(profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
