"""Start the suite's `python -m pagestream...` processes by forking a warm interpreter (a zygote).

Most of the suite's CPU went into the ~330 processes it starts (workers, gateways, bulk-workers), and
most of each start into importing torch, transformers, xgrammar, fastapi and the like before any of
our code ran: ~4.5 s of CPU per worker on the 2-core VM (BENCHMARKS.md, "Test time"). The zygote is
one process per pytest process that imports those third-party packages once, and then, for each
start, forks a child that becomes the requested process: it takes the caller's stdio descriptors, its
working directory, its environment and argv, and runs the module as `python -m` would
(`runpy.run_module(..., run_name="__main__")`), exiting through the interpreter's normal shutdown.

What is not shared: none of pagestream's own modules is imported in the zygote (some read the
environment when imported), so a child imports and runs our code exactly as a fresh interpreter
would. The environment must match the zygote's on everything a preloaded package may have read at
import; where it does not (or the command is not `python -m MODULE ...`, or the caller asks for
something this cannot give, such as `pass_fds`), `spawn` starts the process the ordinary way.
`PAGESTREAM_TEST_ZYGOTE=0` turns the zygote off for a whole run; tests of how processes start
(the CLI's own spawning, `-P`, the entrypoint) use `subprocess` directly and never come here.

`spawn(...)` answers a `subprocess.Popen` (a subclass): poll, wait, kill, terminate, send_signal,
communicate and the pipes behave as for any child. The child is the zygote's, so the zygote reports
its exit status over the connection the request came on.
"""
from __future__ import annotations

import errno
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types

# Imported in the zygote before it serves: what a worker, gateway, serve or bulk-worker imports
# from outside pagestream (from `python -X importtime` of each), plus transformers' lazy parts
# that loading a model and a tokenizer reach.
PRELOAD = (
    "torch", "numpy", "safetensors", "tokenizers", "jinja2",
    "triton", "triton.language.extra.libdevice",
    "transformers", "transformers.configuration_utils", "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers", "transformers.models.auto.auto_factory",
    "transformers.models.auto.auto_mappings", "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto", "transformers.models.encoder_decoder",
    "transformers.utils.type_validators", "transformers.activations", "transformers.integrations.hub_kernels",
    "transformers.core_model_loading", "transformers.generation",
    "xgrammar", "jsonschema",
    "redis", "redis.cluster", "hiredis", "rq", "pydantic", "pydantic_settings", "annotated_types",
    "fastapi", "fastapi.responses", "starlette", "uvicorn", "uvicorn.protocols.http.httptools_impl", "uvloop",
    "httptools", "httpx", "anyio", "multipart", "prometheus_client", "http.server",
    "typer", "click", "rich", "boto3", "botocore", "tqdm",
)

# Environment variables a child may set differently from the zygote: read by our own code (never
# preloaded) or at run time only. Any other difference means a fresh interpreter.
# (The clients' test files set LITELLM_/LANGCHAIN_/... at import, and litellm TIKTOKEN_CACHE_DIR: none of those is read
# at import by a preloaded package; the tokenizers
# library reads TOKENIZERS_PARALLELISM when it decides, not at import.)
# NCCL_ and the like: read when torch.distributed starts (engine/parallel_state.py sets them in-process). What the
# suite's in-process imports set (a full xdist run named them): TORCHINDUCTOR_CACHE_DIR (torch's inductor, read when it
# compiles), HF_XET_HIGH_PERFORMANCE and HF_HUB_ENABLE_HF_TRANSFER (lm-eval; downloads only, and the tests' processes
# download nothing), KMP_DUPLICATE_LIB_OK (Intel's OpenMP runtime; torch's CPU wheel loads GNU's).
_FREE_PREFIXES = ("PAGESTREAM_", "AWS_", "S3_", "PYTEST_", "LITELLM_", "LANGSMITH_", "LANGCHAIN_", "OPENAI_",
                  "HF_DATASETS_", "TIKTOKEN_", "NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_", "TORCHINDUCTOR_", "HF_XET_")
_FREE_KEYS = {"PYTHONUNBUFFERED", "OMP_NUM_THREADS", "REDIS_URL", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR",
              "TOKENIZERS_PARALLELISM", "HF_HUB_ENABLE_HF_TRANSFER", "KMP_DUPLICATE_LIB_OK"}


_START_CWD = os.getcwd()  # in the zygote: the directory its own PYTHONPATH was read in


def _fixed_env(env: dict) -> dict:
    fixed = {k: v for k, v in env.items() if not (k.startswith(_FREE_PREFIXES) or k in _FREE_KEYS)}
    if _pythonpath_is_free(env.get("PYTHONPATH")):
        fixed.pop("PYTHONPATH", None)
    return fixed


def _path_entries(pythonpath: str | None, cwd: str | None = None) -> list[str]:
    """PYTHONPATH's directories as a fresh interpreter puts them on ``sys.path`` (absolute, as ``site`` makes them)."""
    return [os.path.abspath(os.path.join(cwd or os.getcwd(), p)) for p in (pythonpath or "").split(os.pathsep) if p]


def _pythonpath_is_free(pythonpath: str | None) -> bool:
    """Whether a child may take this PYTHONPATH in a zygote started without it: Python reads it once, at startup,
    into ``sys.path`` (``_become`` puts it there), unless a directory of it holds what a fresh interpreter would
    have run or imported before the command: a ``sitecustomize``/``usercustomize``, or a module or regular package
    under the name of one already imported here (which the zygote's preloads roughly are). The bulk tests put the
    checkout's root there, which holds neither (its ``kernels`` is a namespace portion that never outranks an
    installed package)."""
    taken = {name.partition(".")[0] for name in sys.modules}
    for entry in _path_entries(pythonpath):
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in names:
            stem = name[:-3] if name.endswith(".py") else name
            if stem in ("sitecustomize", "usercustomize"):
                return False
            if stem in taken and (name.endswith(".py") or os.path.isfile(os.path.join(entry, name, "__init__.py"))):
                return False
    return True


# ---------------------------------------------------------------------------------------------------
# The zygote (runs as `python tests/zygote.py SOCKET`)
# ---------------------------------------------------------------------------------------------------

def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an extra that is not installed: the child imports it itself
            pass
    transformers = sys.modules.get("transformers")
    for attr in ("AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast"):  # lazy attributes: their modules load now
        try:
            getattr(transformers, attr)
        except Exception:  # noqa: BLE001
            pass
    # What the preloads made lives as long as every child: in the GC's permanent generation, a child's collections
    # (an engine's start-up `gc.collect()`, engine/heap.py) walk only what it allocated itself, and never write
    # to (copy) the inherited pages' GC headers.
    import gc

    gc.collect()
    gc.freeze()


def _serve(path: str) -> dict:
    """Serve fork requests; returns only in a forked child, with the request it is to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its exit status goes to
    try:
        print("zygote ready", flush=True)  # the parent waits for this line on our stdout
    except BrokenPipeError:  # the pytest process ended before it needed us
        os._exit(0)
    while True:
        try:
            ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
        except InterruptedError:
            continue
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            os._exit(0)  # the pytest process is gone
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        while waiting:  # reap whoever exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            req = json.loads(data)
        except (OSError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:  # the child: become the requested process
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for c in (listener, *waiting.values()):
                c.close()
            conn.close()
            os.close(wake_r)
            os.close(wake_w)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)  # dup2 clears close-on-exec on the target; stdio stays inheritable
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            return req
        for fd in fds:
            os.close(fd)
        waiting[pid] = conn
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:
            pass


def _become(req: dict) -> None:
    """In the forked child: take the request's directory, environment, argv and stdio."""
    os.chdir(req["cwd"])
    if req.get("start_new_session"):
        os.setsid()
    old_threads, old_pythonpath = os.environ.get("OMP_NUM_THREADS"), os.environ.get("PYTHONPATH")
    os.environ.clear()
    os.environ.update(req["env"])
    if os.environ.get("PYTHONPATH") != old_pythonpath:  # allowed only where _pythonpath_is_free said so
        for entry in _path_entries(old_pythonpath, _START_CWD):
            if entry in sys.path[1:]:
                sys.path.remove(entry)
        sys.path[1:1] = _path_entries(os.environ.get("PYTHONPATH"))  # after the script's or the working directory
    new_threads = os.environ.get("OMP_NUM_THREADS")
    if new_threads != old_threads and "torch" in sys.modules:
        import torch

        # libgomp read OMP_NUM_THREADS when the zygote loaded it; a fresh process would read the new one
        torch.set_num_threads(int(new_threads) if new_threads else os.cpu_count() or 1)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # numpy's global generator is not reseeded on fork
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    streams = []
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "r":
            stream = io.TextIOWrapper(io.BufferedReader(raw), encoding=sys.stdin.encoding, errors=sys.stdin.errors)
        else:
            buffered = io.BufferedWriter(raw)
            errors = "backslashreplace" if fd == 2 else sys.stdout.errors
            stream = io.TextIOWrapper(buffered, encoding=sys.stdout.encoding, errors=errors,
                                      line_buffering=fd == 2 or unbuffered, write_through=unbuffered or fd == 2)
        streams.append(stream)
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams
    kind, target = req["kind"], req["target"]
    if kind == "module":  # `python -m`: the working directory first; run_module sets argv[0]
        sys.argv, sys.path[0] = ["-m", *req["args"]], os.getcwd()
    elif kind == "code":  # `python -c`
        sys.argv, sys.path[0] = ["-c", *req["args"]], ""
    else:  # `python SCRIPT` (a console script): the script's directory first
        sys.argv, sys.path[0] = [target, *req["args"]], os.path.dirname(os.path.realpath(target))


def main() -> None:
    _preload()
    req = _serve(sys.argv[1])
    _become(req)
    import runpy

    kind, target = req["kind"], req["target"]
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "code":
        import types

        module = types.ModuleType("__main__")
        sys.modules["__main__"] = module
        exec(compile(target, "<string>", "exec"), module.__dict__)
    else:
        runpy.run_path(target, run_name="__main__")


# ---------------------------------------------------------------------------------------------------
# The client (in the pytest process)
# ---------------------------------------------------------------------------------------------------

# The zygotes of this pytest process, although this file may be imported twice (as `zygote` and `tests.zygote`)
_shared = sys.modules.setdefault("_pagestream_test_zygote", types.ModuleType("_pagestream_test_zygote"))
_lock = _shared.__dict__.setdefault("lock", threading.Lock())
#: "zygotes": one per environment seen (at most MAX_ZYGOTES), each {"proc", "path", "env", "ready"};
#: "forked" / "fresh": the counts; "why_fresh": variables whose difference started a new zygote or a fresh process
_state: dict = _shared.__dict__.setdefault("state", {"zygotes": [], "forked": 0, "fresh": 0, "why_fresh": {}})
#: a test run whose environment drifts (a library that sets a variable when a test imports it) gets a zygote for
#: the new one too, up to this many; past it, such processes start fresh
MAX_ZYGOTES = 3


def _enabled() -> bool:
    return os.environ.get("PAGESTREAM_TEST_ZYGOTE", "1") not in ("0", "", "false", "no")


def start() -> None:
    """Start a zygote for this process's environment, in the background (it imports for a few seconds); `spawn`
    waits for it when it needs it (conftest starts one at configure time, so it imports while tests collect)."""
    with _lock:
        _start_locked(dict(os.environ))


def _start_locked(env: dict) -> dict | None:
    fixed = _fixed_env(env)
    for z in _state["zygotes"]:
        if z["env"] == fixed:
            return z
    if not _enabled() or len(_state["zygotes"]) >= MAX_ZYGOTES:
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="pagestream-zygote-"), "sock")
    try:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.abspath(__file__)), env=env)
    except OSError:
        return None
    z = {"proc": proc, "path": path, "env": fixed, "ready": False}
    _state["zygotes"].append(z)
    return z


def _ensure(env: dict) -> dict | None:
    """The ready zygote for ``env`` (started now if none has its environment yet), or None."""
    with _lock:
        first = _state["zygotes"][0]["env"] if _state["zygotes"] else None
        z = _start_locked(env)
        if first is not None and (z is None or z["env"] != first):  # say in the summary what drifted
            fixed = _fixed_env(env)
            for k in sorted(k for k in fixed.keys() | first.keys() if fixed.get(k) != first.get(k)):
                _state["why_fresh"][k] = _state["why_fresh"].get(k, 0) + 1
        if z is None or z.get("off"):
            return None
        proc = z["proc"]
        if not z["ready"]:
            line = b""
            for line in iter(proc.stdout.readline, b""):  # a package may print while the zygote imports
                if line.strip() == b"zygote ready":
                    break
            if line.strip() != b"zygote ready":
                z["off"] = True
                if proc.poll() is None:
                    proc.kill()
                return None
            z["ready"] = True
        if proc.poll() is not None:  # it died: no more forks from it this run
            z["off"] = True
            return None
        return z


def counts() -> tuple[int, int, dict[str, int]]:
    """(processes forked from a zygote, processes `spawn` started the ordinary way, and how often each variable
    differed from the first zygote's environment in a request: those got a zygote of their own, or past
    MAX_ZYGOTES a fresh process) so far."""
    return _state["forked"], _state["fresh"], dict(_state["why_fresh"])


def stop() -> None:
    """End the zygotes (their children are left to their owners)."""
    with _lock:
        for z in _state["zygotes"]:
            z["off"] = True
            proc = z["proc"]
            if proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


class ZygotePopen(subprocess.Popen):
    """A Popen whose child is forked by the zygote rather than exec'd."""

    def __init__(self, args, *, zygote: dict, kind: str, target: str, target_args: list[str], **kwargs):
        self._zy = zygote
        self._zy_req = {"kind": kind, "target": target, "args": list(target_args)}
        self._zy_conn: socket.socket | None = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *rest):
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        req = {**self._zy_req,
               "cwd": os.path.abspath(cwd) if cwd is not None else os.getcwd(),
               "env": dict(env) if env is not None else dict(os.environ),
               "start_new_session": bool(start_new_session or (rest and rest[0] not in (-1, None)))}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self._zy["path"])
            socket.send_fds(conn, [json.dumps(req).encode()], fds)
            reply = json.loads(conn.recv(4096) or b"{}")
        except (OSError, ValueError) as e:
            reply = {"error": str(e)}
        if "pid" not in reply:  # Popen.__init__ closes the pipes it made; `spawn` falls back to a fresh process
            conn.close()
            raise OSError(errno.ECHILD, f"the test zygote did not start {self._zy_req['target']}: {reply}")
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self.pid = reply["pid"]
        self._child_created = True
        self._zy_conn = conn

    def _read_status(self, timeout: float | None) -> bool:
        """Take the exit status if the zygote has sent it within `timeout`; True once known."""
        if self.returncode is not None:
            return True
        conn = self._zy_conn
        if conn is None:
            return False
        ready, _, _ = select.select([conn], [], [], timeout)
        if not ready:
            return False
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        conn.close()
        self._zy_conn = None
        if data:
            self.returncode = json.loads(data)["exit"]
        else:  # the zygote died first: the child was reparented; wait for it to vanish
            while os.path.exists(f"/proc/{self.pid}") and _proc_state(self.pid) not in ("Z", "X"):
                if timeout is not None and timeout <= 0:
                    return False
                select.select([], [], [], 0.05)
            self.returncode = -signal.SIGKILL
        return True

    def _internal_poll(self, _deadstate=None, _waitpid=None, _WNOHANG=None, _ECHILD=None):
        if self.returncode is None:
            with self._waitpid_lock:
                self._read_status(0)
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is not None:
            return self.returncode
        with self._waitpid_lock:
            if not self._read_status(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


_NOT_SUPPORTED = ("preexec_fn", "pass_fds", "shell", "executable", "user", "group", "extra_groups", "umask")


def _how(args: list[str]) -> tuple[str, str, list[str]] | None:
    """("module" | "code" | "path", target, its arguments) for the commands the zygote can run."""
    if len(args) >= 3 and args[0] == sys.executable and args[1] in ("-m", "-c"):
        return ("module" if args[1] == "-m" else "code"), args[2], args[3:]
    if args and os.path.isfile(args[0]) and os.access(args[0], os.X_OK):
        try:
            with open(args[0], "rb") as f:
                first = f.readline(4096)
        except OSError:
            return None
        if first.strip() == b"#!" + os.fsencode(sys.executable):  # a console script of this interpreter
            return "path", args[0], args[1:]
    if len(args) >= 2 and args[0] == sys.executable and not args[1].startswith("-"):
        return "path", args[1], args[2:]
    return None


def spawn(args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`, forked from the zygote when `args` runs this interpreter on a
    module (`-m`), a string (`-c`) or a script (a console script of this venv, or `python SCRIPT`) and
    nothing asks for a fresh interpreter; otherwise the ordinary Popen."""
    args = [os.fspath(a) for a in args]
    how = _how(args)
    usable = (how is not None and _enabled() and not any(kwargs.get(k) for k in _NOT_SUPPORTED)
              and kwargs.get("close_fds", True))
    env = kwargs.get("env")
    zygote = _ensure(dict(env) if env is not None else dict(os.environ)) if usable else None
    if zygote is not None:
        try:
            proc = ZygotePopen(args, zygote=zygote, kind=how[0], target=how[1], target_args=how[2], **kwargs)
            _state["forked"] += 1
            return proc
        except OSError as e:
            if e.errno != errno.ECHILD:
                raise
    _state["fresh"] += 1
    return subprocess.Popen(args, **kwargs)


def run(args, *, input=None, timeout=None, check=False, capture_output=False, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run`, with the process started by `spawn`."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with spawn(args, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    main()
