"""What the engine core says and is told. ``EngineCore.step()`` (engine/llm_engine.py) returns
``TokenBatch`` / ``RequestDelta`` messages, which the ``OutputProcessor`` turns into outputs, in
``LLMEngine`` and on the caller's side of ``EngineProcess`` alike; between ``EngineProcess`` and the
engine core process they cross the pipe in ``CoreOutput`` / ``CoreRequest``. Each message says its
kind (an enum), never its position or length; an error travels as a type and a message
(``EngineCoreError``), never as a string whose prefix names the exception."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagestream.engine.errors import EngineDeadError


class CoreRequestType(enum.Enum):
    ADD = "add"  # payload: list[AddRequest]
    ABORT = "abort"  # payload: list of the core's request ids
    STOP_SAMPLES = "stop_samples"  # payload: list[StopSample] (stop strings the caller found)
    SHUTDOWN = "shutdown"  # no payload


class CoreOutputType(enum.Enum):
    READY = "ready"  # the core is built: limits, config
    FAILED = "failed"  # the core could not start: error
    OUTPUTS = "outputs"  # outputs of one step (maybe none) and, now and then, stats
    STEP_ERROR = "step_error"  # a step raised: error (the core goes on)
    DEAD = "dead"  # the core can step no more (a tensor-parallel rank died): error


class ErrorType(enum.Enum):
    INVALID_CONFIG = "invalid_config"  # what LLMEngine(config) raises as ValueError
    STARTUP = "startup"  # any other start-up failure: a bad model file, OOM, no GPU
    REQUEST = "request"  # one request failed in the core (its output carries it; others go on)
    STEP = "step"  # a step raised
    DEAD = "dead"  # the engine cannot continue


@dataclass(slots=True)
class EngineCoreError:
    type: ErrorType
    message: str
    traceback: str | None = None

    @classmethod
    def of(cls, exc: BaseException, type: ErrorType, traceback: str | None = None) -> "EngineCoreError":
        return cls(type, f"{type_name(exc)}: {exc}", traceback)

    def exception(self) -> Exception:
        """The exception the caller raises for it, as the in-process engine would have."""
        if self.type is ErrorType.INVALID_CONFIG:
            return ValueError(self.message.split(": ", 1)[-1])
        if self.type is ErrorType.DEAD:
            return EngineDeadError(self.message)
        if self.type is ErrorType.STEP:
            return RuntimeError(f"engine core step failed:\n{self.traceback or self.message}")
        return RuntimeError(self.message.split(": ", 1)[-1] if self.type is ErrorType.STARTUP else self.message)


def type_name(exc: BaseException) -> str:
    return type(exc).__name__


class AddRequest(NamedTuple):
    """A request the caller has checked and tokenized (``InputProcessor.process``)."""

    rid: int
    prompt: str | None
    prompt_token_ids: list[int]
    resume_token_ids: list[int]
    params: Any  # SamplingParams, as the core should run it (no stop strings: those are the caller's)
    priority: int


class StopSample(NamedTuple):
    rid: int
    index: int
    stop_reason: str | None


class SampleDelta(NamedTuple):
    index: int
    token_ids: list[int]  # new since the last output
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per new token, when asked
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(NamedTuple):
    """One request's output as it crosses the pipe: only what changed, no objects to build."""

    rid: int
    finished: bool
    error: EngineCoreError | None
    metrics: dict | None  # measured by the core, if any (EngineCore sends none: the OutputProcessor measures)
    samples: list[SampleDelta]
    prompt_logprobs: list | None = None  # the request's, once (RequestOutput.prompt_logprobs)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (RequestOutput.num_cached_tokens)


class TokenBatch(NamedTuple):
    """One new token for each of many single-sample, still running requests without logprobs (the
    common step): two flat lists cross the pipe instead of a ``RequestDelta`` per request."""

    rids: list[int]
    token_ids: list[int]


@dataclass(slots=True)
class CoreRequest:
    type: CoreRequestType
    payload: list = field(default_factory=list)


@dataclass(slots=True)
class CoreOutput:
    type: CoreOutputType
    outputs: list = field(default_factory=list)  # RequestDelta | TokenBatch
    stats: Any = None  # EngineStats
    iteration_tokens: list = field(default_factory=list)  # tokens of each core step since the last message
    error: EngineCoreError | None = None
    limits: Any = None  # EngineLimits (READY)
    config: Any = None  # EngineConfig (READY)
