"""The client side of a chain of shard workers: drive them as one model.

``Pipeline`` (``shard.pipeline.pipeline``) is the entry point; the package, by what each module
owns:

* ``pipeline``: ``Pipeline``, connecting and generating (client relay, chain relay,
  speculation);
* ``checks``: what is checked before a generation runs (the chain, the targets, chunk sizes);
* ``stepping``: client-stepped generation (prefill through the hops, decode, verify drafts);
* ``replicas``: the workers that can serve each hop (``HopReplicas``);
* ``generation``: what every hop of one generation shares (``Generation``, ``Failover``);
* ``runner``: one hop of one generation, the steps sent to it (``HopRunner``);
* ``failover``: where a hop runs and moving it to another replica (``HopFailover``);
* ``held``: the sessions a hop answers for, and giving them up (``release_session``);
* ``history``: what a hop's session holds, and replaying it into a new one (``HopHistory``);
* ``handoff``: moving a draining worker's session state to a replica;
* ``replay``: what a hop keeps so a replica can take over (``TokenLog``, ``RowLog``);
* ``chain``: chain relay as the client drives it (the first hop's runner, its ``Generate``);
* ``route``: a chain's route and how it moves to a failed hop's replica (``ChainRoute``);
* ``drafting``: tokens drafted for speculative verification (``PromptLookup``);
* ``scoring``: a prompt's log-probs, in overlapping ``all_logits`` passes (``score``);
* ``errors``: which hop failed (``PipelineError``, ``Hop``).

It uses ``shard.client`` (one worker) and the protocol's shared pieces (``shard.rpc.errors``,
``convert``, ``routes``, ``shard.deadlines``, ``shard.stops``), never the worker's side.
"""

from .pipeline import *  # noqa: F403 - the package's API is the pipeline module's
from .pipeline import __all__ as __all__
