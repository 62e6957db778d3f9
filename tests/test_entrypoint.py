"""The container entrypoint (issue 13, acceptance 5) outside Docker: it `exec`s pagestream, so SIGTERM
reaches the worker itself, which warm-stops (finishes its running job) and exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pagestream.producer import Producer
from tests.queue_helpers import ROOT, wait_for


def test_entrypoint_execs_so_sigterm_warm_stops_the_worker(redis_url, tmp_path):
    log = tmp_path / "w.log"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "PAGESTREAM_REDIS_URL": redis_url, "PAGESTREAM_MODEL": "fake:40"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(ROOT / "worker" / "entrypoint.sh"), "worker", "--consumer", "ep-w", "--device", "cpu"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "ready" in log.read_text() or proc.poll() is not None, 60, "worker ready")
        assert proc.poll() is None, log.read_text()
        # the process we started is pagestream itself, not a shell waiting on it
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert any(part.endswith(b"pagestream") for part in cmdline) and not cmdline[0].endswith(b"sh"), cmdline
        with Producer.from_url(redis_url) as p:
            job_id = p.submit(prompt="drain me", max_tokens=40)
            wait_for(lambda: p.status(job_id).value == "running", 30, "job running")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()
            res = p.result(job_id, timeout=5)
        assert res.status.value == "completed" and len(res.token_ids) == 40  # drained, not killed
        assert "warm stop" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
