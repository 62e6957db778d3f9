"""The offline front, vLLM-compatible: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence as Seq

from pagestream.engine.config import EngineConfig
from pagestream.engine.llm_engine import LLMEngine
from pagestream.engine.outputs import CompletionOutput, RequestOutput
from pagestream.engine.sampling_params import SamplingParams


class LLM:
    """Generate for a list of prompts at once, continuous batching underneath."""

    def __init__(self, model: str, **kwargs) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | Seq[str] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: Seq[Seq[int]] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts; each holds the whole text of every sample."""
        if isinstance(prompts, str):
            prompts = [prompts]
        inputs: list[tuple[str | None, list[int] | None]]
        if prompt_token_ids is not None:
            inputs = [(None, list(ids)) for ids in prompt_token_ids]
        elif prompts is not None:
            inputs = [(p, None) for p in prompts]
        else:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        return self._run(inputs, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them, through the chat template: the
        model's, or ``chat_template`` (a Jinja string); the other options as vLLM's ``LLM.chat`` takes them
        (``chat_template_kwargs``: extra variables for the template, e.g. ``{"enable_thinking": False}``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        engine = self.llm_engine
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        inputs = [(None, engine.apply_chat_template(conv, tools, **options)) for conv in conversations]
        return self._run(inputs, sampling_params, use_tqdm, None)

    def _run(self, inputs, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        engine = self.llm_engine
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = [sampling_params] * len(inputs) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params_list) != len(inputs):
            raise ValueError(f"got {len(params_list)} sampling params for {len(inputs)} prompts")
        # generate() returns whole outputs: the engine need not detokenize or report every step
        final: dict[int, SamplingParams] = {}
        for k, p in enumerate(params_list):
            if isinstance(p, SamplingParams) and p.output_kind != "final":
                params_list[k] = final.setdefault(id(p), dataclasses.replace(p, output_kind="final"))
        ids = [f"gen-{next(self._ids)}" for _ in inputs]
        added = []
        try:
            for k, ((prompt, token_ids), params) in enumerate(zip(inputs, params_list)):
                engine.add_request(ids[k], prompt=prompt, params=params, prompt_token_ids=token_ids,
                                   priority=priority[k] if priority else 0)
                added.append(ids[k])
        except ValueError:
            # One bad prompt fails the whole call: take back the ones already queued and
            # drop their 'abort' outputs, so the next generate() starts clean.
            for rid in added:
                engine.abort_request(rid)
            engine.step()
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        wanted = set(ids)
        done: set[str] = set()
        while wanted - done:
            for delta in engine.step():
                if delta.request_id not in wanted:
                    continue
                acc = results.get(delta.request_id)
                if acc is None:
                    results[delta.request_id] = acc = RequestOutput(
                        delta.request_id, delta.prompt, delta.prompt_token_ids,
                        [CompletionOutput(c.index, "", [], logprobs=[] if c.logprobs is not None else None)
                         for c in delta.outputs],
                        False,
                    )
                for c, d in zip(acc.outputs, delta.outputs):
                    c.text += d.text
                    c.token_ids.extend(d.token_ids)
                    if d.logprobs is not None:
                        c.logprobs.extend(d.logprobs)
                    c.cumulative_logprob = d.cumulative_logprob
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                acc.finished = delta.finished
                acc.metrics = delta.metrics
                acc.error = delta.error or acc.error  # e.g. a grammar that cannot compile
                if delta.prompt_logprobs is not None:
                    acc.prompt_logprobs = delta.prompt_logprobs
                acc.num_cached_tokens = delta.num_cached_tokens
                if delta.finished:
                    done.add(delta.request_id)
                    if bar is not None:
                        bar.update(1)
            if not engine.has_unfinished_requests() and wanted - done:
                raise RuntimeError("engine stopped before every request finished")
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]
