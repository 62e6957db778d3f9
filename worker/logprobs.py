"""Log probabilities as jobs carry them: the engine's per-token dicts -> ``TokenLogprob``'s wire form.

The engine gives, per output token, ``{token_id: logprob}`` for the sampled token and
its top-k. A subscriber (the gateway, a web backend) has no tokenizer, so the worker
names each token here: every id is decoded on its own, once (a cache per worker, at
most the vocabulary), and the list goes into the token event beside its ids.
"""
from __future__ import annotations

from typing import Any

from pagestream.producer.protocol.schema import MIN_LOGPROB


def _finite(lp: float) -> float:
    # -inf (a token the sampler rules out) and NaN cannot cross JSON; <= 0 by definition
    return min(lp, 0.0) if lp >= MIN_LOGPROB else MIN_LOGPROB


class TokenTexts:
    """Token id -> its text decoded alone, and the engine's logprob dicts in wire form."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._texts.get(token_id)
        if t is None:
            # A model without a tokenizer serves prompt_token_ids only: name the id, as vLLM does.
            t = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._texts[token_id] = t
        return t

    def encode(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> list[list]:
        """One ``[token_id, token, logprob, [[id, token, logprob] x k]]`` per token (``TokenLogprob``).

        The engine's dict holds the top-k and the sampled token (k + 1 entries when the
        sampled one is not among the top k); the alternatives are the k most likely,
        most likely first (a stable sort: on a tie the engine's top-k order stands).
        """
        assert len(token_ids) == len(logprobs), (len(token_ids), len(logprobs))  # the engine reports them together
        text = self.text
        out = []
        for tok, d in zip(token_ids, logprobs):
            top = sorted(((t, _finite(v)) for t, v in d.items()), key=lambda tv: -tv[1])[:k]
            out.append([tok, text(tok), _finite(d.get(tok, MIN_LOGPROB)), [[t, text(t), v] for t, v in top]])
        return out

    def encode_prompt(self, token_ids: list[int], logprobs: list[dict[int, float] | None], k: int) -> list[list]:
        """The engine's prompt logprobs (None for the first token, then a dict per token) in the same wire form;
        the first token's entry names it, with logprob None and no alternatives."""
        first = [token_ids[0], self.text(token_ids[0]), None, []]
        return [first, *self.encode(token_ids[1:], logprobs[1:], k)]
