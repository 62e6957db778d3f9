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


def warm_up_backend(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """Import xgrammar and build the model's tokenizer table on a background thread, so the first constrained
    request finds both ready (~0.3 s of import and ~0.2 s of table for SmolLM2 on one core, which on the
    step thread held every request of the batch back). Returns the thread, or None without xgrammar.

    The thread is not a daemon: a script that builds an engine and exits at once waits for it (under a
    second) at interpreter exit. As a daemon, it could still be inside xgrammar's C++ when the process tore
    down that library's statics, and the process died of ``terminate called without an active exception``
    (SIGABRT) after its work was done."""
    import importlib.util
    import threading

    if importlib.util.find_spec("xgrammar") is None:
        return None

    def warm() -> None:
        try:
            from pagestream.engine.structured_output.backend_xgrammar import tokenizer_info

            tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        except Exception:  # the first constrained request builds it again and reports what fails
            import logging

            logging.getLogger(__name__).debug("structured outputs warm-up failed", exc_info=True)

    thread = threading.Thread(target=warm, name="grammar-warm-up", daemon=False)
    thread.start()
    return thread


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagestream.engine.structured_output' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"pagestream.engine.structured_output.{module}"), name)
    globals()[name] = value
    return value
