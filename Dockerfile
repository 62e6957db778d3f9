# pagestream's image: one image for worker, bulk-worker and gateway (the command picks).
#   docker build -t pagestream:cpu .                                        # CPU (default)
#   docker build -t pagestream:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # CUDA
# TORCH_SPEC is the Makefile's pin (tests/test_compose.py checks they agree).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HOME=/hf-cache
WORKDIR /app
# torch first, from its own index, so the pin holds and the layer survives code changes
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml /app/
COPY . /app
RUN pip install '.[engine,gateway]' && chmod +x /app/worker/entrypoint.sh
ENTRYPOINT ["/app/worker/entrypoint.sh"]
CMD ["worker"]
