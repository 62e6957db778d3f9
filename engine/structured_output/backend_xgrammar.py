"""xgrammar behind one small interface: compile a constraint (on a thread pool, cached by its
spec, with a timeout) and make per-request matchers from the result.

Compilation runs off the step's critical path: ``submit`` returns a future at once, the
engine keeps stepping other requests and asks ``ready``/``result`` later. Compiled grammars
are kept in an LRU keyed by ``StructuredOutputsParams.key()``, so a bulk of 100k lines with
one schema compiles once (``stats().compilations == 1``, the rest ``cache_hits``).
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from pagestream.engine.structured_output.params import StructuredOutputsParams


class StructuredOutputError(ValueError):
    """A constraint the backend cannot compile (bad schema, regex, grammar) or that took too long; the
    message is the compiler's, so a user can fix the request."""


@dataclass(slots=True)
class BackendStats:
    compilations: int = 0  # grammars compiled (cache misses that finished)
    cache_hits: int = 0  # requests whose grammar was compiled (or compiling) already
    compile_errors: int = 0
    compile_s: float = 0.0  # seconds spent compiling, summed over compilations


def _compiler_message(exc: BaseException) -> str:
    # xgrammar's errors start with "[hh:mm:ss] /project/cpp/file.cc:123: "; keep what follows
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = rest.strip()
    return text.replace("Check failed: (error.empty()) is false: ", "")


# xgrammar's tokenizer table (~0.2 s for a 49k vocabulary, on the calling thread) per tokenizer, vocab_size and
# stop ids: built once per process, by the engine's warm-up thread at start (warm_up_backend) rather than on the
# step thread under the first constrained request, where it stalled every request in the batch (issue 37, acc. 3)
_TOKENIZER_INFOS: OrderedDict[tuple, tuple[Any, xgr.TokenizerInfo]] = OrderedDict()
_TOKENIZER_INFOS_LOCK = threading.Lock()


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None) -> xgr.TokenizerInfo:
    """The model's ``xgr.TokenizerInfo``, cached: a second engine on the same tokenizer files (or a caller racing the
    warm-up thread, which then waits for it) gets the same table."""
    name = getattr(tokenizer, "name_or_path", None)
    key = (name if isinstance(name, str) and name else id(tokenizer), len(tokenizer), vocab_size,
           tuple(stop_token_ids or ()))
    with _TOKENIZER_INFOS_LOCK:
        hit = _TOKENIZER_INFOS.get(key)
        if hit is None:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=stop_token_ids or None)
            hit = _TOKENIZER_INFOS[key] = (tokenizer, info)  # the tokenizer kept: an id() key stays its own
            while len(_TOKENIZER_INFOS) > 8:
                _TOKENIZER_INFOS.popitem(last=False)
        _TOKENIZER_INFOS.move_to_end(key)
        return hit[1]


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of ``choices`` (each a JSON-escaped EBNF string literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarBackend:
    """One model's compiler: its tokenizer info (with the model's ``vocab_size``, which is often
    padded past the tokenizer's), a compile pool and an LRU of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 max_threads: int = 4, cache_size: int = 256, compile_timeout_s: float = 60.0) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # xgrammar's own cache is off: ours is keyed by the spec, bounded, and counts
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self.stats = BackendStats()

    # ---- compiling -------------------------------------------------------------------------------

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar: the cached one, or a compilation started on the pool."""
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return fut
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """Compile (or fetch) and wait: for tests, start-up checks and callers off the step loop."""
        return self.result(self.submit(params), timeout_s=timeout_s, started=time.monotonic())

    def result(self, fut: Future, *, timeout_s: float | None = None, started: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of a ready future, or ``StructuredOutputError``; waits at most the
        rest of the compile timeout counted from ``started``."""
        limit = self.compile_timeout_s if timeout_s is None else timeout_s
        wait = None if started is None else max(0.0, limit - (time.monotonic() - started))
        try:
            return fut.result(timeout=wait)
        except TimeoutError:
            raise StructuredOutputError(f"the grammar did not compile within {limit:g} s") from None

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        t0 = time.perf_counter()
        any_whitespace = not params.disable_any_whitespace
        try:
            kind = params.kind
            if kind in ("json", "json_object"):
                compiled = self._compiler.compile_json_schema(
                    json.dumps(params.json_schema()), any_whitespace=any_whitespace, strict_mode=True)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(choice_grammar(params.choice))
            else:
                compiled = self._compile_grammar(params.grammar)
        except Exception as exc:
            with self._lock:
                self.stats.compile_errors += 1
            raise StructuredOutputError(f"invalid {params.kind} for structured outputs: {_compiler_message(exc)}") from None
        with self._lock:
            self.stats.compilations += 1
            self.stats.compile_s += time.perf_counter() - t0
        return compiled

    def _compile_grammar(self, grammar: str) -> xgr.CompiledGrammar:
        # EBNF (GBNF: "root ::= ...") first; a grammar it cannot lex that reads as Lark ("start: ...") goes to
        # the Lark front end, and an error names the form it was taken for
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as ebnf_exc:
            if "::=" in grammar:
                raise
            try:
                return self._compiler.compile_lark(grammar)
            except Exception as lark_exc:
                raise RuntimeError(f"not EBNF ({_compiler_message(ebnf_exc)}) nor Lark "
                                   f"({_compiler_message(lark_exc)})") from None

    # ---- matching --------------------------------------------------------------------------------

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
