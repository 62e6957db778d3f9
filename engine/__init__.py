"""pagestream's inference engine: paged KV cache, continuous batching, vLLM-style API.

    from pagestream.engine import LLM, SamplingParams
    llm = LLM(model="path/to/hf-model-dir", gpu_memory_utilization=0.85)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.7, max_tokens=256))
    print(outputs[0].outputs[0].text)

Importing this package pulls in no torch; ``LLM`` and ``LLMEngine`` load it when built.
"""
from pagestream.engine.config import EngineConfig
from pagestream.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.structured_output.params import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineStats"]


def __getattr__(name: str):
    if name == "LLM":
        from pagestream.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagestream.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
