"""Structured outputs (constrained decoding): a request's output is held to a JSON schema, a regex, a choice
of strings or a grammar by masking, before each token is sampled, the tokens the constraint forbids.

    bitmask.py             the packed token bitmask ([N, ceil(V/32)] int32) and its use on the logits
    backend.py             the grammar backend interface (compile a constraint, a per-request matcher)
    llguidance_backend.py  the backend built on llguidance
    constraints.py         an engine's matchers of its live constrained requests
"""
