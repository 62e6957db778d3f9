"""The Redis contract: what producers, workers and the bulk path agree on.

Schema (``schema``), key names (``keys``), the layout of stream entries (``wire``), lanes and
their shards (``lanes``), size limits (``limits``), the parser for untrusted JSON
(``untrusted``), Redis connections (``redis_conn``), shared settings (``settings``), log
redaction (``redaction``) and the command line's shared conventions (``cli``). Workers import
only this package (and the bulk storage they write parts to).
"""
