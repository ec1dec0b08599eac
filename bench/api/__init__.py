"""Benches of the OpenAI-compatible front door (``overhead``: what it adds per token;
``abuse``: what an abusive client costs its neighbours) and of a pool of routes
(``pool_spread``: the load spread over two workers)."""
