"""What reading one gRPC message costs the transport, on h2's path and on the inbound short
path (``BoundedH2.receive_data``), in process: no sockets, no event loop, no handler.

A server-side ``BoundedH2`` with one open stream reads DATA frames each holding one message
(``--sizes`` bytes of payload: 8 is a client's Decode, 40 a served token, 2,000 a small hidden
state), one frame a read and ``--per-read`` frames a read; each message is consumed as a
handler would (``consumed``), so the ledger acknowledges as in a real call. The two paths
alternate round by round (``--rounds``) and each round reads ``--messages`` messages; reported:
the median CPU microseconds (``time.process_time``) a message on each path and their ratio.

    python -m bench.worker.inbound_frames [--sizes 8,40,2000] [--per-read 8] [--messages 20000]
        [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import time
from typing import Any

import h2.config
import h2.connection

from bench.common import options
from bench.common.environment import environment, save_record
from shard.rpc.transport import wire

HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/shard.v1.Shard/Session"),
           (":authority", "bench"), ("te", "trailers"), ("content-type", "application/grpc")]


def _open(fast: bool) -> tuple[wire.BoundedH2, int]:
    """A server-side connection with one open stream (no frame budget: a real client earns its
    small frames with the answers it is sent)."""
    conn = wire.BoundedH2(wire.TransportLimits(), client_side=False)
    conn.fast_inbound = fast
    conn.initiate_connection()
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    peer.initiate_connection()
    peer.receive_data(conn.data_to_send())
    sid = peer.get_next_available_stream_id()
    peer.send_headers(sid, HEADERS)
    conn.receive_data(peer.data_to_send())
    conn.data_to_send()
    return conn, sid


def per_message_us(fast: bool, size: int, per_read: int, messages: int) -> float:
    conn, sid = _open(fast)
    body = struct.pack(">?I", False, size) + bytes(size)
    frame = struct.pack(">BHBBI", len(body) >> 16, len(body) & 0xFFFF, 0, 0, sid) + body
    data = frame * per_read
    start = time.process_time()
    for _ in range(messages // per_read):
        for event in conn.receive_data(data):
            conn.consumed(sid, event.flow_controlled_length + wire.PREFIX)
        conn.data_to_send()
    return (time.process_time() - start) / (messages // per_read * per_read) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,40,2000", help="message payloads in bytes (default 8,40,2000)")
    p.add_argument("--per-read", type=int, default=8, help="frames a read in the batched case (default 8)")
    p.add_argument("--messages", type=int, default=20000, help="messages a round (default 20000)")
    options.add_rounds(p, 5, "rounds, the two paths alternating (default 5)")
    options.add_out(p, options.RESULTS / "inbound_frames.json")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    cases = [(s, 1) for s in sizes] + [(sizes[0], args.per_read)]
    results: dict[str, Any] = {}
    for size, per_read in cases:
        runs: dict[str, list[float]] = {"h2": [], "short": []}
        for r in range(args.rounds):
            for name in ("h2", "short") if r % 2 == 0 else ("short", "h2"):
                runs[name].append(per_message_us(name == "short", size, per_read, args.messages))
        h2_us, short_us = statistics.median(runs["h2"]), statistics.median(runs["short"])
        results[f"{size}B_x{per_read}"] = {"h2_us": h2_us, "short_us": short_us,
                                           "ratio": short_us / h2_us, "runs": runs}
    save_record(args.out, {"environment": environment(None, 1, argv=sys.argv if argv is None
                                                      else ["bench.worker.inbound_frames", *argv]),
                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
