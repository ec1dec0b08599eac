"""Chain relay, the worker's side: a worker that relays a routed session to the next hop.

``serve(relay=ChainRelay(...))`` (``trio-shard serve --allow-relay``) lets a worker take sessions
opened with a route (``OpenSession.route``: the hops after it). The package, by what each module
owns:

* ``policy``: where the worker may connect (``PeerList``, ``serve --relay-peers``) and which
  routes it takes (``check_route``): the operator's, never the caller's, decision;
* ``peers``: the pooled connections to those peers (``PeerPool``);
* ``chain_relay``: ``ChainRelay``, the ``Relay`` a worker's sessions are given: it opens the
  next hop's session and the return pusher, with the relay's outbound credentials;
* ``downstream``: the next hop's session as a routed step drives it (``NextHop``) and a last
  hop's direct return (``ReturnPusher``);
* ``ledger``: a routed session's positions, one owner and one rule (``ChainLedger``);
* ``routed``: the steps of a routed session (``RoutedSession``);
* ``returns``: a first hop's direct-return slots (``DirectReturns``).

Where it sits: beside the client pipeline (``shard.pipeline``, the client's side of a chain),
above ``shard.client`` (the relay is a client of the next worker) and ``shard.rpc`` (it uses the
session's step API, ``shard.rpc.session.StepHost``). Nothing in ``shard.rpc`` imports it: the
server is handed a ``Relay`` (a protocol of ``shard.rpc.session``) by whoever starts it, the
CLI's ``serve --allow-relay``. It never imports the client pipeline, nor the pipeline it.
"""

from .chain_relay import ChainRelay
from .ledger import ChainLedger
from .peers import PeerPool, PoolLimits
from .policy import LOOPBACK, Peer, PeerList, PeerListError, check_route

__all__ = [
    "LOOPBACK",
    "ChainLedger",
    "ChainRelay",
    "Peer",
    "PeerList",
    "PeerListError",
    "PeerPool",
    "PoolLimits",
    "check_route",
]
