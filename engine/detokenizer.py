"""Incremental detokenization with stop strings (plain Python, tokenizer-agnostic).

What a sample has emitted after k output tokens is a pure function of those k
tokens: a request resumed from its published tokens on another worker carries
on exactly where the text left off.
"""
from __future__ import annotations

from engine.sampling_params import SamplingParams


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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Feed one output token. Returns True when a stop string ended the text."""
        self.output_ids.append(token_id)
        if self.tokenizer is None or self.stop_reason is not None:
            return False
        prefix = self._decode(self.output_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.output_ids[self._prefix_offset :])
        # An unfinished multi-byte character decodes to U+FFFD: wait for the rest.
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.output_ids)
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
        """At the end, a trailing partial character is shown as U+FFFD, as a plain decode would."""
        if self.tokenizer is None or self.stop_reason is not None or self._read_offset == len(self.output_ids):
            return
        prefix = self._decode(self.output_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.output_ids[self._prefix_offset :])
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self.output_ids)

    def take_delta(self, finished: bool) -> str:
        """The text that may be shown now; all of it once the sample is finished."""
        if finished:
            self._flush()
        limit = len(self.text) if finished or not self.hold else max(self.num_emitted, len(self.text) - self.hold)
        delta = self.text[self.num_emitted : limit]
        self.num_emitted = max(self.num_emitted, limit)
        return delta
