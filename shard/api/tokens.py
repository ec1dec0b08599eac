"""llama-server's ``/tokenize`` and ``/detokenize``, through the first worker's ``Tokenize`` RPC.

Why: chat UIs and agents count a prompt's tokens before they send it (to trim a conversation
to the context), and debug a template by its ids; llama-server's shapes are what they call.
The ids are the first worker's own (the door holds no tokenizer), so they equal what a
generation of the same text is prefilled with (``add_special``: the BOS; ``parse_special``:
control-token texts become their tokens, as the door's prompts are tokenized).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shard.v1 import shard_pb2 as pb

__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenized", "tokenized"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def unsupported(self) -> tuple[str, str] | None:
        return None


class TokenizeRequest(_Strict):
    """``POST /tokenize``: llama-server's body (its defaults), ``model`` where several are served."""

    model: str | None = None
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def tokenized(reply: pb.TokenizeResponse, with_pieces: bool) -> dict[str, Any]:
    """``{"tokens": [ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}``: a piece is its
    text when its bytes are whole UTF-8, else the list of its bytes (as llama-server's)."""
    if not with_pieces:
        return {"tokens": list(reply.tokens)}
    return {"tokens": [{"id": t, "piece": _piece(p)} for t, p in zip(reply.tokens, reply.pieces,
                                                                       strict=True)]}


def detokenized(reply: pb.TokenizeResponse) -> dict[str, Any]:
    """``{"content": text}``: the tokens' bytes as one UTF-8 text (invalid bytes: U+FFFD)."""
    return {"content": b"".join(reply.pieces).decode("utf-8", "replace")}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
