"""``POST /v1/embeddings`` in OpenAI's shapes: the inputs a request names, checked, and its
answer (floats, or base64 of little-endian float32 as the official client asks by default).

Why the checks here rather than only on the worker: each refusal names the input it is about
(``input[3]``), which a worker that sees one call's slice of the batch cannot, and a bad batch
costs no worker call.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from shard.rpc.convert import MAX_EMBED_INPUTS
from shard.v1 import shard_pb2 as pb

from .errors import ApiError
from .schemas import EmbeddingRequest

__all__ = ["MAX_EMBED_INPUTS", "embedding_inputs", "embedding_reply", "embedding_values"]


def embedding_values(context: int) -> int:
    """The most JSON values an embeddings body may hold: every input may be a string (one
    value each), and token-id inputs may hold eight sessions' positions in all (a generation's
    body may hold eight per position, ``shard.api.bodies.value_limit``)."""
    return 8 * max(context, 1) + 2 * MAX_EMBED_INPUTS + 1024


def embedding_inputs(body: EmbeddingRequest, *, n_vocab: int, context: int) -> list[str | list[int]]:
    """The request's inputs, one per embedding, in order: a text, a list of texts, a list of
    token ids (one input) or a list of such lists. Each is refused with a 400 naming it when
    it is empty, holds an id outside the vocabulary or more ids than ``context``."""
    raw: Any = body.input
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]
    else:
        items = list(raw)
    if not items:
        raise ApiError(400, "input must not be empty", param="input", code="invalid_parameter")
    if len(items) > MAX_EMBED_INPUTS:
        raise ApiError(400, f"input holds {len(items)} items; at most {MAX_EMBED_INPUTS}",
                       param="input", code="invalid_parameter")
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 else f"input[{i}]"
        if not item:
            raise ApiError(400, f"{where} is empty", param="input", code="invalid_parameter")
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\ud800" is valid JSON)
                raise ApiError(400, f"{where} is not valid Unicode (a lone surrogate)",
                               param="input", code="invalid_parameter") from None
            continue
        if len(item) > context:
            raise ApiError(400, f"{where} holds {len(item)} tokens, more than the {context} "
                           "positions of a session", param="input", code="context_length_exceeded")
        if not all(0 <= t < n_vocab for t in item):
            raise ApiError(400, f"{where}: token ids must be in [0, {n_vocab})", param="input",
                           code="invalid_parameter")
    return items


def embedding_reply(model: str, embeddings: Sequence[pb.Embedding], *, as_base64: bool) -> dict[str, Any]:
    """OpenAI's answer: a list of ``embedding`` objects in input order and the tokens read."""
    data = []
    for i, e in enumerate(embeddings):
        values = np.asarray(e.values, dtype="<f4")
        encoded: Any = (base64.b64encode(values.tobytes()).decode("ascii") if as_base64
                        else values.tolist())
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = sum(e.n_tokens for e in embeddings)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
