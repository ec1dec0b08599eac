"""The generated code in ``shard/v1/`` is exactly what ``python -m shard.rpc.codegen`` produces
from ``proto/``: editing the .proto without regenerating (or hand-editing generated files)
fails here."""

from __future__ import annotations

import difflib
from pathlib import Path

from shard.rpc import codegen


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    generated = codegen.generate(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in generated] == list(codegen.GENERATED)
    stale = []
    for fresh in generated:
        rel = fresh.relative_to(tmp_path)
        committed = codegen.ROOT / rel
        assert committed.exists(), f"{rel} is missing: run python -m shard.rpc.codegen"
        if committed.read_bytes() != fresh.read_bytes():
            diff = difflib.unified_diff(
                committed.read_text().splitlines(), fresh.read_text().splitlines(),
                f"committed/{rel}", f"regenerated/{rel}", lineterm="", n=1,
            )
            stale.append("\n".join(list(diff)[:40]))
    assert not stale, "stale generated code; run python -m shard.rpc.codegen\n" + "\n".join(stale)


def test_generated_package_lists_only_generated_files() -> None:
    """Nothing else hides in shard/v1 (besides its package marker and caches)."""
    v1 = codegen.ROOT / "shard" / "v1"
    names = {p.name for p in v1.iterdir() if p.name != "__pycache__"}
    assert names == {"__init__.py", *(Path(g).name for g in codegen.GENERATED)}
