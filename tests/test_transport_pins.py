"""h2 and hyperframe are pinned, and the private names of h2 / hyperframe / purerpc that
shard/rpc/transport uses are checked at import, so an upgrade fails loudly (issue 14, item 6)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from shard.rpc.transport import wire

ROOT = Path(__file__).resolve().parents[1]


def test_h2_and_hyperframe_are_pinned_to_the_installed_versions() -> None:
    """The transport uses their private names: only the versions it was written against."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins = {}
    for requirement in project["dependencies"]:
        if m := re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9.]+)", requirement.strip()):
            pins[m.group(1).lower()] = m.group(2)
    for name in ("h2", "hyperframe", "purerpc"):
        assert pins.get(name) == metadata.version(name), (name, pins.get(name))
        assert wire.PINNED[name] == pins[name], name


def test_every_private_name_the_transport_uses_exists() -> None:
    assert wire.missing_private_names() == []


def test_a_missing_private_name_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    import h2.frame_buffer

    monkeypatch.delattr(h2.frame_buffer.FrameBuffer, "_validate_frame_length")
    missing = wire.missing_private_names()
    assert missing == ["h2.frame_buffer.FrameBuffer._validate_frame_length"]
    with pytest.raises(ImportError, match=r"h2==3\.2\.0.*_validate_frame_length") as info:
        wire.check_private_names()
    assert "pyproject.toml" in str(info.value)
