"""TLS contexts and bearer tokens from the command's options: the worker's server side
(``serve --tls-*``) and every client side (``--tls-ca``, ``--tls-cert``/``--tls-key``,
``--token-file``). A file that cannot be used is a ValueError naming the option and the file,
since ssl's own messages name neither ("[SSL] PEM lib")."""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def tls_pair_given(args: argparse.Namespace) -> bool:
    """Whether ``--tls-cert`` and ``--tls-key`` are given (ValueError for one alone)."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    return args.tls_cert is not None


def tls_load(what: str, load: Callable[[], T]) -> T:
    """One TLS file load; a file that cannot be read or used is a ValueError naming ``what``
    (the options and files)."""
    try:
        return load()
    except OSError as exc:  # ssl.SSLError included
        raise ValueError(f"cannot load {what}: {exc.strerror or exc}") from None


def server_ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """TLS for ``serve``: certificate + key, and with --tls-client-ca, required client certs."""
    if not tls_pair_given(args):
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_load(f"--tls-cert {args.tls_cert} with --tls-key {args.tls_key}",
             lambda: ctx.load_cert_chain(args.tls_cert, args.tls_key))
    if args.tls_client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        tls_load(f"--tls-client-ca {args.tls_client_ca}",
                 lambda: ctx.load_verify_locations(args.tls_client_ca))
    return ctx


def client_options(args: argparse.Namespace) -> dict[str, object]:
    """``ShardClient.connect`` keywords: TLS and the bearer token (ValueError/OSError/SSLError)."""
    from shard.rpc.auth import bearer_metadata, first_token

    metadata = bearer_metadata(first_token(args.token_file)) if args.token_file else ()
    return {"ssl_context": client_ssl_context(args), "metadata": metadata}


def client_ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """Client TLS: enabled by --tls-ca (or a client certificate)."""
    pair = tls_pair_given(args)
    if args.tls_ca is None and not pair:
        return None
    where = f"--tls-ca {args.tls_ca}" if args.tls_ca is not None else "the system CA certificates"
    ctx = tls_load(where, lambda: ssl.create_default_context(cafile=args.tls_ca))
    if pair:
        tls_load(f"--tls-cert {args.tls_cert} with --tls-key {args.tls_key}",
                 lambda: ctx.load_cert_chain(args.tls_cert, args.tls_key))
    return ctx
