"""Wire compatibility: replay recorded request bytes against a live worker and compare the
responses, for every supported protocol version; refuse every unsupported one.

Fixtures live in ``tests/fixtures/wire/v{major}.{minor}/*.json``. Each holds one or more calls
made in order against a fresh worker (FakeEngine, ``WIRE_MODEL``): the serialized request bytes
(base64), the responses that followed each request, the final gRPC status and the
``shard-error-bin`` trailer. Text renderings sit next to the bytes for review only.

Record the newest version's directory (after an intended protocol or FakeEngine change; review
the diff)::

    .venv/bin/python tests/test_wire_compat.py --record

A new protocol version gets its own directory and recipes; old directories are never
re-recorded, they are what older routers send.

The client is grpcio with identity serializers, so the exact recorded bytes go on the wire.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from google.protobuf import text_format
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

if __name__ == "__main__":  # run as a script: find rpc_harness and the package
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from rpc_harness import no_engine_leaks  # noqa: F401 - autouse: no sessions/KV cells leak
from rpc_harness import Requests, in_thread, loaded, running_server  # noqa: E402
from shard.engine.fake import FakeEngine, FakeModel  # noqa: E402
from shard.rpc.convert import cache_expectation  # noqa: E402
from shard.rpc.errors import ERROR_TRAILER  # noqa: E402
from shard.rpc.versions import SUPPORTED_VERSIONS, is_supported  # noqa: E402
from shard.v1 import shard_pb2 as pb  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "wire"
WIRE_MODEL = FakeModel(n_layers_total=2, n_embd=8, seed=2024)  # fixed: fixtures depend on it

RPCS: dict[str, tuple[type[Message], type[Message]]] = {
    "GetCapabilities": (pb.GetCapabilitiesRequest, pb.GetCapabilitiesResponse),
    "Health": (pb.HealthRequest, pb.HealthResponse),
    "Session": (pb.SessionRequest, pb.SessionResponse),
    "Cancel": (pb.CancelRequest, pb.CancelResponse),
    "Release": (pb.ReleaseRequest, pb.ReleaseResponse),
    "GetMetrics": (pb.GetMetricsRequest, pb.GetMetricsResponse),
    "GroupSteps": (pb.GroupStepRequest, pb.GroupStepResponse),
}
STREAMS = ("Session", "GroupSteps")


# ---- recipes (what the recorder sends, per version) ------------------------------------------


def _recipes(major: int, minor: int) -> dict[str, list[tuple[str, list[Message]]]]:
    v = pb.ProtocolVersion(major=major, minor=minor)

    def s(**kind: Any) -> pb.SessionRequest:
        return pb.SessionRequest(version=v, **kind)

    prompt = [1, 3 + ord("h"), 3 + ord("i")]
    added: dict[str, list[tuple[str, list[Message]]]] = {}
    if (major, minor) >= (1, 2):  # session hand-off: a state out, and one refused on the way in
        foreign = pb.StateHeader(model_fingerprint="0" * 64, layer_range=pb.LayerRange(end=2),
                                 kv_layout="x", n_past=3, has_tokens=True, tokens=prompt,
                                 data_bytes=8, data_sha256=bytes(32))
        added["session_handoff"] = [("Session", [
            s(open=pb.OpenSession(session_id="wire-7")),
            s(prefill=pb.Prefill(tokens=pb.TokenIds(ids=prompt))),
            s(export_state=pb.ExportState(max_chunk_bytes=4096)),
            s(close=pb.CloseSession()),
        ]), ("Session", [
            s(open=pb.OpenSession(session_id="wire-8")),
            s(import_state=pb.StateChunk(header=foreign, data=bytes(8), last=True)),
            s(prefill=pb.Prefill(tokens=pb.TokenIds(ids=prompt))),
            s(close=pb.CloseSession()),
        ])]
    if (major, minor) >= (1, 3):  # group steps: a row of no live session, and an empty tick
        added["group_steps"] = [("GroupSteps", [
            pb.GroupStepRequest(version=v, rows=[pb.GroupRow(session_id="nobody",
                                                             decode=pb.Decode(token=5))]),
            pb.GroupStepRequest(version=v),
        ])]
    return added | {
        "capabilities": [("GetCapabilities", [pb.GetCapabilitiesRequest(version=v)])],
        "health": [("Health", [pb.HealthRequest(version=v)])],
        "metrics": [("GetMetrics", [pb.GetMetricsRequest(version=v)])],
        "cancel_and_release_unknown": [
            ("Cancel", [pb.CancelRequest(version=v, session_id="nobody")]),
            ("Release", [pb.ReleaseRequest(version=v, session_id="nobody")]),
        ],
        "session_lifecycle": [("Session", [
            s(open=pb.OpenSession(session_id="wire-1", initial_credit=4)),
            s(prefill=pb.Prefill(tokens=pb.TokenIds(ids=prompt), top_logprobs=2)),
            s(decode=pb.Decode(token=3 + ord("!"), sampling=pb.SamplingParams(temperature=0.8, seed=9))),
            s(credit=pb.Credit(messages=2)),  # 2 of 4 used: 4 again, enough for 3 + 1
            s(generate=pb.Generate(max_tokens=3, top_logprobs=1)),
            s(credit=pb.Credit(messages=4)),
            s(generate=pb.Generate(text=" ok", max_tokens=2)),
            s(close=pb.CloseSession(retain=False)),
        ])],
        "session_step_errors": [("Session", [
            s(open=pb.OpenSession(session_id="wire-2")),
            s(prefill=pb.Prefill(tokens=pb.TokenIds(ids=[1, 100_000]))),
            s(decode=pb.Decode(hidden_state=pb.Tensor(data=b"\0" * 32, shape=[1, 8], dtype="float32"))),
            s(generate=pb.Generate(max_tokens=0)),
            s(prefill=pb.Prefill(tokens=pb.TokenIds(ids=prompt))),
            s(close=pb.CloseSession()),
        ])],
        "session_resume": [
            ("Session", [
                s(open=pb.OpenSession(session_id="wire-3")),
                s(prefill=pb.Prefill(tokens=pb.TokenIds(ids=prompt))),
                s(close=pb.CloseSession(retain=True)),
            ]),
            ("Session", [
                s(open=pb.OpenSession(session_id="wire-3", cache=cache_expectation(prompt))),
                s(close=pb.CloseSession(retain=True)),
            ]),
            ("Session", [
                s(open=pb.OpenSession(session_id="wire-3", cache=cache_expectation([1, 2]))),
                s(close=pb.CloseSession(retain=True)),
            ]),
            ("Release", [pb.ReleaseRequest(version=v, session_id="wire-3")]),
        ],
        "session_decode_before_open": [("Session", [s(decode=pb.Decode(token=5))])],
        "session_second_open": [("Session", [
            s(open=pb.OpenSession(session_id="wire-4")),
            s(open=pb.OpenSession(session_id="wire-5")),
        ])],
        "session_incompatible_model": [("Session", [
            s(open=pb.OpenSession(session_id="wire-6", expected_model_fingerprint="0" * 64)),
        ])],
    }


def _terminator(request: Message) -> str | None:
    """The response kind that ends the exchange for ``request`` (None: it gets no response;
    "": the first response, as a GroupStepRequest gets exactly one)."""
    if isinstance(request, pb.GroupStepRequest):
        return ""
    kind = request.WhichOneof("kind")  # type: ignore[attr-defined]
    return {"open": "opened", "close": "closed", "credit": None}.get(kind or "", "usage")


# ---- running calls with grpcio (blocking: call from a thread) --------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _text(msg: Message) -> str:
    return text_format.MessageToString(msg, as_one_line=True)


def _trailer(exc_or_call: Any) -> bytes | None:
    for key, value in exc_or_call.trailing_metadata() or ():
        if key == ERROR_TRAILER:
            return bytes(value)
    return None


def _record_call(channel: grpc.Channel, rpc: str, requests: list[Message]) -> dict[str, Any]:
    """Run one call lock-step, reading each request's responses before sending the next."""
    req_type, resp_type = RPCS[rpc]
    exchanges: list[dict[str, Any]] = []
    path = f"/shard.v1.Shard/{rpc}"
    if rpc not in STREAMS:
        method = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        data = requests[0].SerializeToString()
        responses: list[bytes] = []
        try:
            responses.append(method(data, timeout=10))
            status, error = grpc.StatusCode.OK, None
        except grpc.RpcError as exc:
            status, error = exc.code(), _trailer(exc)
        exchanges.append({"request": data, "responses": responses})
        return _call_record(rpc, exchanges, status, error, req_type, resp_type)

    method = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
    feed = Requests()
    call = method(iter(feed), timeout=10)
    it: Iterator[bytes] = iter(call)
    ended = False
    try:
        for request in requests:
            data = request.SerializeToString()
            feed.put(data)  # type: ignore[arg-type]
            got: list[bytes] = []
            until = _terminator(request)  # type: ignore[arg-type]
            while until is not None and not ended:
                try:
                    raw = next(it)
                except StopIteration:
                    ended = True
                    break
                except grpc.RpcError:
                    ended = True
                    break
                got.append(raw)
                if until == "" or resp_type.FromString(raw).WhichOneof("kind") == until:
                    break
            exchanges.append({"request": data, "responses": got})
            if ended:
                break
    finally:
        feed.end()
    rest = []
    try:
        rest = list(it)
    except grpc.RpcError:
        pass
    if rest:
        exchanges.append({"request": None, "responses": rest})
    return _call_record(rpc, exchanges, call.code(), _trailer(call), req_type, resp_type)


def _call_record(
    rpc: str, exchanges: list[dict[str, Any]], status: grpc.StatusCode, error: bytes | None,
    req_type: type[Message], resp_type: type[Message],
) -> dict[str, Any]:
    return {
        "rpc": rpc,
        "exchanges": [
            {
                "request": None if e["request"] is None else _b64(e["request"]),
                "request_text": None if e["request"] is None else _text(req_type.FromString(e["request"])),
                "responses": [_b64(r) for r in e["responses"]],
                "responses_text": [_text(resp_type.FromString(r)) for r in e["responses"]],
            }
            for e in exchanges
        ],
        "status": status.name,
        "error": None if error is None else {"bytes": _b64(error), "text": _text(pb.Error.FromString(error))},
    }


async def _run_calls(calls: list[tuple[str, list[Message]]]) -> list[dict[str, Any]]:
    engine = FakeEngine(model=WIRE_MODEL)
    async with loaded(engine), running_server(engine) as server:
        with grpc.insecure_channel(server.target) as channel:
            records = []
            for rpc, requests in calls:
                records.append(await in_thread(_record_call, channel, rpc, requests))
                with trio.fail_after(10):
                    await server.registry.streams.wait_value(0)
            return records


# ---- comparison -----------------------------------------------------------------------------


#: Repeated fields a newer worker may extend at the end (see ``_close``).
APPENDABLE = ("supported_versions", "hidden_wire_dtypes")


def _close(actual: Any, expected: Any, where: str) -> None:
    """Structural equality; floats (logprobs) within 1e-4 so BLAS rounding cannot break it.

    What a newer minor adds is allowed: fields the recording lacks (a client of the recorded
    version ignores unknown fields) and newer entries at the end of ``APPENDABLE`` lists
    (``supported_versions``; ``hidden_wire_dtypes``: a client asks only for a dtype it knows).
    Everything recorded must come back equal.
    """
    if isinstance(expected, float) or isinstance(actual, float):
        assert math.isclose(float(actual), float(expected), rel_tol=1e-4, abs_tol=1e-4), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() >= expected.keys(), f"{where}: {actual} != {expected}"
        for key in expected:
            got = actual[key]
            if key in APPENDABLE:
                got = got[: len(expected[key])]
            _close(got, expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: {actual} != {expected}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _close(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _as_dict(msg: Message) -> dict[str, Any]:
    """A comparable form; human-readable texts (error messages, cache reasons) may change."""
    d = MessageToDict(msg, preserving_proto_field_name=True)
    d.get("error", {}).pop("message", None)
    d.get("opened", {}).get("cache", {}).pop("reason", None)
    return d


def _fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("v*/*.json"))


@pytest.mark.parametrize("path", _fixture_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
async def test_replay_recorded_fixture(path: Path) -> None:
    fixture = json.loads(path.read_text())
    calls = [
        (c["rpc"], [RPCS[c["rpc"]][0].FromString(_unb64(e["request"])) for e in c["exchanges"] if e["request"]])
        for c in fixture["calls"]
    ]
    actual = await _run_calls(calls)
    assert len(actual) == len(fixture["calls"])
    for i, (got, want) in enumerate(zip(actual, fixture["calls"], strict=True)):
        where = f"{path.name} call {i} ({want['rpc']})"
        resp_type = RPCS[want["rpc"]][1]
        assert got["status"] == want["status"], where
        assert len(got["exchanges"]) == len(want["exchanges"]), where
        for j, (g, w) in enumerate(zip(got["exchanges"], want["exchanges"], strict=True)):
            _close(
                [_as_dict(resp_type.FromString(_unb64(r))) for r in g["responses"]],
                [_as_dict(resp_type.FromString(_unb64(r))) for r in w["responses"]],
                f"{where} exchange {j}",
            )
        if want["error"] is None:
            assert got["error"] is None, where
        else:
            assert got["error"] is not None, where
            g_err = pb.Error.FromString(_unb64(got["error"]["bytes"]))
            w_err = pb.Error.FromString(_unb64(want["error"]["bytes"]))
            g_err.message = w_err.message = ""  # wording may improve; the fields may not change
            assert g_err == w_err, where


def test_every_supported_version_has_fixtures() -> None:
    for major, minor in SUPPORTED_VERSIONS:
        directory = FIXTURES / f"v{major}.{minor}"
        assert sorted(p.stem for p in directory.glob("*.json")) == sorted(_recipes(major, minor)), directory


# ---- fail-closed: every RPC refuses every unsupported version before any engine work ------------

UNSUPPORTED = [(2, 0), (1, 4), (0, 9), (0, 0), None]


def _with_version(rpc: str, version: tuple[int, int] | None) -> Message:
    req_type = RPCS[rpc][0]
    msg = req_type()
    if rpc == "Session":
        msg.open.session_id = "old-router"
    elif rpc in ("Cancel", "Release"):
        msg.session_id = "old-router"
    elif rpc == "GroupSteps":
        msg.rows.add(session_id="old-router")
    if version is not None:
        msg.version.CopyFrom(pb.ProtocolVersion(major=version[0], minor=version[1]))
    return msg


@pytest.mark.parametrize("version", UNSUPPORTED, ids=lambda v: "missing" if v is None else f"v{v[0]}.{v[1]}")
async def test_unsupported_versions_are_refused_on_every_rpc(version: tuple[int, int] | None) -> None:
    assert version is None or not is_supported(*version)
    calls = [(rpc, [_with_version(rpc, version)]) for rpc in RPCS]
    engine = FakeEngine(model=WIRE_MODEL)
    async with loaded(engine), running_server(engine) as server:
        with grpc.insecure_channel(server.target) as channel:
            for rpc, requests in calls:
                record = await in_thread(_record_call, channel, rpc, requests)
                assert record["status"] == "FAILED_PRECONDITION", rpc
                assert all(not e["responses"] for e in record["exchanges"]), rpc
                err = pb.Error.FromString(_unb64(record["error"]["bytes"]))
                assert err.code == pb.ERROR_CODE_UNSUPPORTED_VERSION and not err.retryable, rpc
                assert [(v.major, v.minor) for v in err.supported_versions] == list(SUPPORTED_VERSIONS)
        assert engine.metrics().sessions_opened_total == 0


# ---- recorder -----------------------------------------------------------------------------------


def record(versions: list[tuple[int, int]] | None = None) -> list[Path]:
    """(Re-)record the fixtures of ``versions`` (default: the newest supported version only;
    older directories are what older routers send and are never re-recorded)."""
    written = []
    for major, minor in versions or [SUPPORTED_VERSIONS[-1]]:
        directory = FIXTURES / f"v{major}.{minor}"
        directory.mkdir(parents=True, exist_ok=True)
        for name, calls in _recipes(major, minor).items():
            records = trio.run(_run_calls, calls)
            path = directory / f"{name}.json"
            path.write_text(json.dumps({"version": f"{major}.{minor}", "calls": records}, indent=1) + "\n")
            written.append(path)
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Re-record the Shard wire fixtures.")
    parser.add_argument("--record", action="store_true", help="write tests/fixtures/wire/vX.Y/")
    newest = "{}.{}".format(*SUPPORTED_VERSIONS[-1])
    parser.add_argument("--version", default=newest, help=f"the version to record (default {newest})")
    args = parser.parse_args()
    if not args.record:
        parser.error("pass --record to overwrite the fixtures")
    major, _, minor = args.version.partition(".")
    for p in record([(int(major), int(minor))]):
        print(p.relative_to(FIXTURES.parent.parent.parent))
