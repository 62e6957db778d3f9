"""The served models: what live workers announced (``max_model_len`` with each), cached briefly."""
from __future__ import annotations

import json
import time

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.protocol import model_card, model_list
from pagestream.producer.gateway.state import GatewayState
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import JobRequest


def _info(raw: bytes | None) -> dict:
    try:
        v = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


class OpenAIServingModels:
    def __init__(self, state: GatewayState) -> None:
        self.producer, self.refresh_s = state.producer, state.settings.model_refresh_s
        self._models: dict[str, dict] = {}
        self._until = 0.0

    async def served(self) -> dict[str, dict]:
        """Model name -> what its workers announced."""
        if time.monotonic() >= self._until:
            names = await self.producer.live_models()
            infos = await self.producer.redis.hmget(keys.model_info(), names) if names else []
            self._models = {n: _info(raw) for n, raw in zip(names, infos)}
            self._until = time.monotonic() + self.refresh_s
        return self._models

    async def check(self, model: str, max_tokens: int | None) -> None:
        """404 for a model nobody serves; 400 when ``max_tokens`` leaves no room in its context."""
        served = await self.served()
        if model not in served:
            raise GatewayError(404, f"The model '{model}' does not exist or no worker serves it (served: {sorted(served) or 'none'})",
                               param="model", code="model_not_found")
        limit = served[model].get("max_model_len")
        if max_tokens is not None and isinstance(limit, int) and max_tokens >= limit:
            # vLLM's words: clients recognise a context overflow by them (LiteLLM's ContextWindowExceededError)
            raise GatewayError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                               f"context length is {limit} tokens, which leaves no room for the prompt",
                               param="max_tokens", code="context_length_exceeded")

    async def check_tokens(self, model: str, jobs: list[JobRequest], logit_bias_ids: list[int]) -> None:
        """400 for token ids outside the served vocabulary (prompt ids, ``stop_token_ids``, ``allowed_token_ids``,
        ``logit_bias`` keys),
        checked against what the model's workers announced, so no worker spends a step on them."""
        vocab = (await self.served()).get(model, {}).get("vocab_size")
        if not isinstance(vocab, int):
            return  # a worker that did not announce it: the engine checks at admission
        for job in jobs:
            ids = job.prompt_token_ids or []
            if ids and max(ids) >= vocab:
                raise GatewayError(400, f"Token id {max(ids)} is out of vocabulary (vocabulary size {vocab})", param="prompt")
            stops = job.sampling.stop_token_ids or []
            if stops and max(stops) >= vocab:
                raise GatewayError(400, f"stop_token_ids contain out-of-vocab token id {max(stops)} (vocabulary size {vocab})",
                                   param="stop_token_ids")
            allowed = job.sampling.allowed_token_ids or []
            if allowed and max(allowed) >= vocab:  # vLLM's words
                raise GatewayError(400, f"allowed_token_ids contains out-of-vocab token id {max(allowed)} (vocabulary size "
                                   f"{vocab})", param="allowed_token_ids")
        bad = sorted(t for t in logit_bias_ids if not 0 <= t < vocab)
        if bad:
            raise GatewayError(400, f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}",
                               param="logit_bias")

    async def list(self) -> dict:
        return model_list(await self.served())

    async def retrieve(self, model: str) -> dict:
        """One model object; 404 (OpenAI's ``model_not_found``) for a model nobody serves."""
        served = await self.served()
        if model not in served:
            raise GatewayError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
        return model_card(model, served[model])
