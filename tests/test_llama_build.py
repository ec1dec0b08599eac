"""The llama.cpp build is the one the project asked for (shard/llama_build.py).

These tests check the *installed* library, not only the build recipe: the native libraries in use
must be byte-identical to the wheel built with the recorded flags (so no wheel that pip found in
a cache, or built later with other flags, can stand in), and llama.cpp's own system info must
agree with the profile (the default build never contains AMX or AVX-512 kernels).
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as lc
import pytest

from shard import llama_build

ROOT = Path(__file__).resolve().parent.parent


def _record() -> dict[str, object]:
    record = llama_build.installed_build()
    assert record is not None, (
        "llama-cpp-python was not installed by shard/llama_build.py (run `make test`, which "
        "installs it; a plain `pip install` compiles llama.cpp with -march=native)"
    )
    return record


def test_installed_build_is_the_requested_profile() -> None:
    record = _record()
    wanted = llama_build.plan(llama_build.requested_profile())
    assert record["key"] == wanted["key"]
    assert record["cmake_args"] == wanted["cmake_args"]


def test_installed_libraries_are_the_recorded_wheel() -> None:
    record = _record()
    site_dir = Path(llama_cpp.__file__).resolve().parent.parent
    assert llama_build.installed_libraries_match(site_dir, record) == []


def test_system_info_agrees_with_the_profile() -> None:
    record = _record()
    info = lc.llama_print_system_info().decode()
    # Every profile: ggml's own thread pool, no OpenMP team (shard/engine/llama_threads.py).
    assert "OPENMP" not in info, info
    if record["profile"] == "native":
        return  # whatever this CPU offers: nothing to hold it to
    assert "AMX" not in info and "AVX512" not in info, info
    if record["profile"] == "portable" and llama_build._is_x86():
        for feature in ("AVX2", "FMA", "F16C"):
            assert f"{feature} = 1" in info, info


def test_profiles_and_cache_keys() -> None:
    portable = llama_build.cmake_args("portable")
    native = llama_build.cmake_args("native")
    assert "-DGGML_NATIVE=OFF" in portable and "-DGGML_NATIVE=ON" in native
    assert not any(a.startswith(("-DGGML_AMX", "-DGGML_AVX512")) and a.endswith("=ON") for a in portable)
    assert "-DGGML_BACKEND_DL=OFF" in portable  # no runtime variant loading (no AMX variant)
    assert all("-DGGML_OPENMP=OFF" in llama_build.cmake_args(p) for p in llama_build.PROFILES)
    keys = {llama_build.plan(p)["key"] for p in llama_build.PROFILES}
    assert len(keys) == len(llama_build.PROFILES)  # a wheel is never reused across flags
    assert llama_build.plan("portable") == llama_build.plan("portable")  # stable


def test_unknown_profile_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "shard" / "llama_build.py"), "show"],
        capture_output=True, text=True, env={"TRIO_SHARD_LLAMA_BUILD": "fastest", "PATH": ""},
    )
    assert proc.returncode != 0
    assert "choose one of portable, baseline, native" in proc.stderr


def test_show_prints_the_plan_and_the_installed_build() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "shard" / "llama_build.py"), "show"],
        capture_output=True, text=True, check=True,
    )
    shown = json.loads(proc.stdout)
    assert shown["plan"]["key"] == llama_build.plan(llama_build.requested_profile())["key"]
    assert shown["installed"]["key"] == _record()["key"]


@pytest.mark.parametrize("profile", llama_build.PROFILES)
def test_cmake_args_are_sorted_and_unique(profile: str) -> None:
    args = llama_build.cmake_args(profile)
    assert list(args) == sorted(set(args))


# ---- install() checks the installed libraries against its record (no real build) -------------

LIBS = {"llama_cpp/lib/libllama.so": b"\x7fELF llama", "llama_cpp/lib/libggml-cpu.so": b"\x7fELF ggml"}


def fake_wheel(path: Path, libs: dict[str, bytes]) -> Path:
    """A wheel holding only native libraries, with a RECORD as a real one lists them."""
    rows = []
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in libs.items():
            zf.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{name},sha256={digest},{len(data)}")
        record = "llama_cpp_python-0.3.36.dist-info/RECORD"
        zf.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")
    return path


class FakeBuild:
    """The wheel cache and pip as ``install`` uses them: ``ensure_wheel`` hands out a fake
    wheel (nothing is compiled), ``pip install`` unpacks its libraries into a temporary site
    directory and is counted."""

    def __init__(self, tmp: Path, profile: str) -> None:
        self.site, self.prefix = tmp / "site-packages", tmp / "venv"
        self.wheel = fake_wheel(tmp / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl", LIBS)
        self.record = {**llama_build.plan(profile), "wheel": self.wheel.name}
        self.pip_installs = 0

    def ensure_wheel(self, profile: str) -> tuple[Path, dict[str, object]]:
        return self.wheel, dict(self.record)

    def pip(self, *args: str, **_: object) -> None:
        assert args[0] == "install" and str(self.wheel) in args
        self.pip_installs += 1
        with zipfile.ZipFile(self.wheel) as zf:
            zf.extractall(self.site, [n for n in zf.namelist() if n.startswith("llama_cpp/")])

    def install(self, profile: str) -> dict[str, object]:
        return llama_build.install(profile, prefix=self.prefix, site=self.site)


@pytest.mark.parametrize(
    "damage", ["none", "changed-library", "missing-library", "record-without-libraries", "other-build"]
)
def test_install_reinstalls_unless_the_installed_libraries_are_the_recorded_ones(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = "portable"
    fake = FakeBuild(tmp_path, profile)
    monkeypatch.setattr(llama_build, "ensure_wheel", fake.ensure_wheel)
    monkeypatch.setattr(llama_build, "_pip", fake.pip)
    monkeypatch.setattr(llama_build, "_llama_cpp_importable", lambda: True)

    first = fake.install(profile)  # nothing installed yet: installs and records the libraries
    assert fake.pip_installs == 2 and set(first["libraries"]) == set(LIBS)  # type: ignore[arg-type]
    assert llama_build.installed_build(fake.prefix) == first
    path = llama_build.record_path(fake.prefix)
    lib = fake.site / "llama_cpp/lib/libllama.so"
    if damage == "changed-library":
        lib.write_bytes(b"\x7fELF built elsewhere with -march=native")  # a later pip install
    elif damage == "missing-library":
        lib.unlink()
    elif damage == "record-without-libraries":  # written by an older llama_build
        path.write_text(json.dumps({k: v for k, v in first.items() if k != "libraries"}))
    elif damage == "other-build":
        path.write_text(json.dumps({**first, "key": "native-0123456789abcdef"}))

    fake.pip_installs = 0
    again = fake.install(profile)
    assert fake.pip_installs == (0 if damage == "none" else 2)
    assert again == first == llama_build.installed_build(fake.prefix)
    assert llama_build.installed_libraries_match(fake.site, again) == []
    assert lib.read_bytes() == LIBS["llama_cpp/lib/libllama.so"]
