"""Incremental detokenization with stop strings (plain Python, tokenizer-agnostic).

What a sample has emitted after k output tokens is a pure function of those k
tokens: a request resumed from its published tokens on another worker carries
on exactly where the text left off.

Fast (Rust) tokenizers decode one token per call through ``tokenizers``'
``DecodeStream``; others use the prefix/read-offset method.
"""
from __future__ import annotations

from pagestream.engine.sampling_params import SamplingParams


#: tokens decoded at the end to see whether a character is unfinished (a UTF-8 character is at most
#: 4 bytes, so at most 4 byte-fallback tokens)
_TAIL_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop_strs = params.stop_strs
        # A possible start of a stop string is held back (never emitted in part).
        self.hold = max((len(s) for s in self.stop_strs), default=1) - 1
        self.output_ids: list[int] = []
        self.text = ""  # decoded output so far (cut at a stop string)
        self.num_emitted = 0  # chars of `text` already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self.stop_reason: str | None = None
        self._stream = None
        # Only the final text is wanted and no stop string needs watching: decode once, at the end.
        self.deferred = params.output_kind == "final" and not self.stop_strs
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        # transformers' decode() first converts its input to Python ints, an isinstance check per token
        # (a third of decode()'s ~75 us for a 256-token output on the H200's host, paid by every sample on
        # the step that finishes it); ours are ints already, so go straight to the tokenizer's own _decode,
        # which does the rest of decode()'s work (special tokens, clean-up of spaces), fast or slow tokenizer.
        self._decode_ids = getattr(tokenizer, "_decode", None) or getattr(tokenizer, "decode", None)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _new_text(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        prefix = self._decode(self.output_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.output_ids[self._prefix_offset :])
        # An unfinished multi-byte character decodes to U+FFFD: wait for the rest.
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.output_ids)
        return full[len(prefix) :]

    def add_token(self, token_id: int) -> bool:
        """Feed one output token. Returns True when a stop string ended the text."""
        self.output_ids.append(token_id)
        if self.tokenizer is None or self.stop_reason is not None or self.deferred:
            return False
        new = self._new_text(token_id)
        if not new:
            return False
        before = len(self.text)
        self.text += new
        if self.stop_strs:
            start = max(0, before - self.hold)
            hits = [(self.text.find(s, start), s) for s in self.stop_strs]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, stop = min(hits)
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                self.stop_reason = stop
                return True
        return False

    def _flush(self) -> None:
        """At the end, a trailing partial character shows as U+FFFD, as a plain decode would."""
        if self.tokenizer is None or self.stop_reason is not None or not self.output_ids:
            return
        # A stream holds back only an unfinished character, which a decode of the last few tokens
        # shows as a trailing U+FFFD; without one there is nothing to add (and no whole-output decode,
        # ~0.1 ms a sample, to pay on the step that finishes a batch).
        if self._stream is not None and not self._decode(self.output_ids[-_TAIL_TOKENS:]).endswith("\ufffd"):
            return
        full = self._decode(self.output_ids)
        if len(full) > len(self.text) and full.startswith(self.text):
            self.text = full

    def take_delta(self, finished: bool) -> str:
        """The text that may be shown now; all of it once the sample is finished."""
        if self.deferred:
            if not finished or self.tokenizer is None:
                return ""
            self.text = self._decode(self.output_ids)
        elif finished:
            self._flush()
        limit = len(self.text) if finished or not self.hold else max(self.num_emitted, len(self.text) - self.hold)
        delta = self.text[self.num_emitted : limit]
        self.num_emitted = max(self.num_emitted, limit)
        return delta
