"""vLLM's tokenizer endpoints (``serving_tokenization``), answered through a worker's tokenizer.

The gateway has no tokenizer: each request is checked here (schema, model served, token ids in the
announced vocabulary), becomes one ``TokenizerCall`` on the model's call list, and waits up to
``tokenizer_timeout_s`` for a worker's reply (``producer.protocol.tokenization``); no reply is a 503.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.protocol import MAX_LISTED_ERRORS, check_trusted_template, first_error_loc
from pagestream.producer.gateway.state import GatewayState
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.chat_template import BOTH_PROMPT_OPTIONS, check_chat_template, check_template_kwargs
from pagestream.producer.protocol.openai import ChatMessageIn
from pagestream.producer.protocol.schema import JobRequest, format_validation_error
from pagestream.producer.protocol.tokenization import CALLS_TTL_S, TokenizerCall, TokenizerOp, parse_reply
from pagestream.producer.protocol.tools import ChatTool


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessageIn]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered by the template, as a chat request's are


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[StrictInt]


def _parse(cls: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise GatewayError(400, format_validation_error(exc, max_errors=MAX_LISTED_ERRORS), param=first_error_loc(exc)) from None


class OpenAIServingTokenization:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.redis, self.timeout_s = state.producer.redis, state.settings.tokenizer_timeout_s

    async def _model(self, model: str) -> dict:
        served = await self.state.models.served()
        if model not in served:
            raise GatewayError(404, f"The model '{model}' does not exist or no worker serves it (served: {sorted(served) or 'none'})",
                               param="model", code="model_not_found")
        return served[model]

    async def _call(self, model: str, op: TokenizerOp, args: dict[str, Any]) -> dict[str, Any]:
        """One call to a worker serving ``model``: its result, 400 for what its tokenizer refused, 503 for no reply."""
        call = TokenizerCall.new(op, args, self.timeout_s)
        calls = keys.tokenizer_calls(model)
        pipe = self.redis.pipeline(transaction=False)
        pipe.lpush(calls, call.dumps())
        pipe.expire(calls, CALLS_TTL_S)
        await pipe.execute()
        popped = await self.redis.blpop([keys.tokenizer_reply(call.id)], timeout=self.timeout_s)
        if popped is None:
            raise GatewayError(503, f"no worker serving '{model}' answered the tokenizer call within {self.timeout_s:g} s; "
                               "try again later", type="service_unavailable", code="tokenizer_timeout")
        try:
            ok, result = parse_reply(popped[1])
        except (ValueError, AttributeError):
            raise GatewayError(503, "a worker sent a malformed tokenizer reply", type="service_unavailable") from None
        if not ok:
            raise GatewayError(400, result)
        return result

    async def prompt_len(self, model: str, job: JobRequest) -> int | None:
        """A job's prompt length in tokens by a worker's tokenizer (chat: its template applied, as the
        worker applies it), or None when no worker answered in time (the engine checks at admission)."""
        if job.messages is not None:
            op, args = TokenizerOp.TOKENIZE_CHAT, {"messages": [m.model_dump(exclude_none=True) for m in job.messages]}
            if job.tools:
                args["tools"] = job.tools
            # the template call the worker will make (its options as the job carries them)
            args["add_generation_prompt"] = job.add_generation_prompt is not False
            args["continue_final_message"] = bool(job.continue_final_message)
            if job.chat_template is not None:
                args["chat_template"] = job.chat_template
            if job.chat_template_kwargs:
                args["chat_template_kwargs"] = job.chat_template_kwargs
        else:
            op, args = TokenizerOp.TOKENIZE, {"prompt": job.prompt}
        try:
            return len((await self._call(model, op, args)).get("tokens") or [])
        except GatewayError as exc:
            if exc.status == 503:
                return None
            raise

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``{count, max_model_len, tokens, token_strs}`` for a prompt or chat messages."""
        if "messages" in body:
            req = _parse(TokenizeChatRequest, body)
            if req.continue_final_message and req.add_generation_prompt:
                raise GatewayError(400, BOTH_PROMPT_OPTIONS, param="continue_final_message")
            # the same options, checks and trust as a chat completion's
            check_trusted_template(req.chat_template, req.chat_template_kwargs,
                                   self.state.settings.trust_request_chat_template)
            op = TokenizerOp.TOKENIZE_CHAT
            args = {"messages": [m.flat() for m in req.messages], "add_generation_prompt": req.add_generation_prompt,
                    "continue_final_message": req.continue_final_message}
            for name, check in (("chat_template", check_chat_template), ("chat_template_kwargs", check_template_kwargs)):
                value = getattr(req, name)
                if value is not None:
                    try:
                        args[name] = check(value)
                    except ValueError as exc:
                        raise GatewayError(400, str(exc), param=name) from None
            if req.tools:
                args["tools"] = [t.for_template() for t in req.tools]
        else:
            req = _parse(TokenizeCompletionRequest, body)
            op, args = TokenizerOp.TOKENIZE, {"prompt": req.prompt}
        info = await self._model(req.model)
        args.update(add_special_tokens=req.add_special_tokens, return_token_strs=req.return_token_strs)
        result = await self._call(req.model, op, args)
        tokens = result.get("tokens") or []
        return {"count": len(tokens), "max_model_len": info.get("max_model_len"), "tokens": tokens,
                "token_strs": result.get("token_strs")}

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/detokenize``: ``{prompt}`` for token ids of the model's vocabulary."""
        req = _parse(DetokenizeRequest, body)
        info = await self._model(req.model)
        vocab = info.get("vocab_size")
        bad = sorted({t for t in req.tokens if t < 0 or (isinstance(vocab, int) and t >= vocab)})
        if bad:
            raise GatewayError(400, f"token id(s) {bad[:10]} are out of vocabulary (vocabulary size {vocab})", param="tokens")
        return await self._call(req.model, TokenizerOp.DETOKENIZE, {"tokens": req.tokens})

    async def tokenizer_info(self, model: str | None) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info`` (only when enabled: 404 otherwise): the tokenizer's class and configuration.
        ``?model=`` picks the model; without it, the one model served."""
        if not self.state.settings.enable_tokenizer_info_endpoint:
            raise GatewayError(404, "Not Found: /tokenizer_info is disabled (start the gateway with --enable-tokenizer-info-endpoint)",
                               code="not_found")
        if model is None:
            served = sorted(await self.state.models.served())
            if len(served) != 1:
                raise GatewayError(400, f"name the model: ?model=<one of {served or 'none'}>", param="model")
            model = served[0]
        await self._model(model)
        return await self._call(model, TokenizerOp.INFO, {})
