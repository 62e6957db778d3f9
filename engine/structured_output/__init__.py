"""Structured outputs: constrain a request's text to a JSON schema, any JSON object, a regex,
a choice or a grammar (xgrammar), as vLLM's ``v1/structured_output``.

``StructuredOutputsParams`` is plain Python and imported eagerly; the backend, matchers and
the bitmask (xgrammar, torch) load on first use, so ``SamplingParams`` stays torch-free.
"""
from pagestream.engine.structured_output.params import KINDS, StructuredOutputsParams

__all__ = ["KINDS", "StructuredOutputsParams", "StructuredOutputError", "StructuredOutputManager",
           "StructuredOutputGrammar", "XgrammarBackend", "apply_bitmask", "allocate_bitmask"]

_LAZY = {
    "StructuredOutputError": "backend_xgrammar",
    "XgrammarBackend": "backend_xgrammar",
    "StructuredOutputManager": "manager",
    "StructuredOutputGrammar": "grammar",
    "apply_bitmask": "bitmask",
    "allocate_bitmask": "bitmask",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagestream.engine.structured_output' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"pagestream.engine.structured_output.{module}"), name)
    globals()[name] = value
    return value
