"""The grammar backend's own verdict on a structured-outputs spec, given when the job is checked.

The engine compiles a constraint with xgrammar against the model's tokenizer; a spec xgrammar
refuses (a lookahead regex, a grammar without ``root``, an unresolvable ``$ref``) used to pass the
job schema and fail on the worker as a 500 and a dead letter. Where xgrammar is installed (the
``engine`` extra; ``pagestream serve`` has it), the same compiler entry points the engine calls
(``compile_json_schema`` with ``strict_mode``, ``compile_regex``, ``compile_grammar``, then
``compile_lark``) run here over a 257-token byte vocabulary, so the gateway and bulk lines answer
400 / an error line before anything is queued. The same matcher then says whether the spec's
language can start at all: a grammar that admits no first byte and cannot end (``root ::= root``)
would only ever run to ``max_tokens``, and is refused too.

Without xgrammar (a producer-only install) this check is skipped and the worker's compile still
refuses the spec (the job fails with the compiler's message). Compiled verdicts are cached by spec.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import threading
from typing import Any

#: byte tokens 0-255 and one stop token
_STOP_ID = 256
_lock = threading.Lock()


@functools.cache
def _backend() -> Any:
    """(xgrammar, a compiler over the byte vocabulary), or None where xgrammar is not installed."""
    if importlib.util.find_spec("xgrammar") is None:
        return None
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"], stop_token_ids=[_STOP_ID])
    return xgr, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def available() -> bool:
    return _backend() is not None


def warm_up() -> None:
    """Import xgrammar now (it loads torch: about 2 s), e.g. in a thread at the gateway's start, so the
    first constrained request does not wait for it."""
    _backend()


def _message(exc: BaseException) -> str:
    # xgrammar's errors start with "[hh:mm:ss] /project/cpp/file.cc:123: "; keep what follows
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = rest.strip()
    return text.replace("Check failed: (error.empty()) is false: ", "")


def choice_grammar(choices: list[str] | tuple[str, ...]) -> str:
    """EBNF accepting exactly one of ``choices`` (the engine builds the same)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=512)
def _verdict(kind: str, spec: str, any_whitespace: bool) -> str | None:
    """None when the backend takes the spec, else what is wrong with it."""
    backend = _backend()
    if backend is None:
        return None
    xgr, compiler = backend
    try:
        with _lock:  # one compiler, used from the event loop's worker threads too
            if kind == "json":
                compiled = compiler.compile_json_schema(spec, any_whitespace=any_whitespace, strict_mode=True)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(json.loads(spec)))
            else:
                try:
                    compiled = compiler.compile_grammar(spec)
                except Exception as ebnf_exc:
                    if "::=" in spec:
                        raise
                    try:
                        compiled = compiler.compile_lark(spec)
                    except Exception as lark_exc:
                        raise RuntimeError(f"not EBNF ({_message(ebnf_exc)}) nor Lark ({_message(lark_exc)})") from None
    except Exception as exc:
        return _message(exc)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, _STOP_ID + 1)
    matcher.fill_next_token_bitmask(mask)
    if not bool(mask.any()):
        return "its language is empty: no output can start or end under it"
    return None


def check_spec(kind: str, value: Any, where: str) -> None:
    """ValueError naming ``where`` (the field's path in the body) when the backend would refuse the spec.
    Whitespace options do not change whether a spec compiles; the check compiles with the default."""
    if value is None:
        return
    spec = json.dumps(value, sort_keys=True) if kind in ("json", "choice") else str(value)
    problem = _verdict(kind, spec, True)
    if problem is not None:
        raise ValueError(f"{where} cannot be compiled by the grammar backend: {problem}")
