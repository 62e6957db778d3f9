"""``/tokenize``, ``/detokenize``, ``/tokenizer_info``: vLLM's tokenizer endpoints, answered by a worker's tokenizer."""
