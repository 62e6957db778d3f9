"""The import rules of ARCHITECTURE.md, checked on the source and in a clean interpreter."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "producer": {"torch", "triton", "transformers", "engine", "kernels", "worker"},
    "engine": {"redis", "pydantic", "pydantic_settings", "boto3", "producer", "worker", "rq"},
    "kernels": {"engine", "producer", "worker", "redis", "pydantic"},
}


def _top(module: str) -> str:
    """The package an import names: ``pagestream.engine.config`` -> ``engine``, ``torch.nn`` -> ``torch``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pagestream" and len(parts) > 1 else parts[0]


def imported_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _top(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "pagestream":
                for alias in node.names:
                    yield alias.name, node.lineno
            else:
                yield _top(node.module), node.lineno


def test_every_import_goes_through_the_pagestream_root():
    """``import engine`` would load a second copy of the package beside ``pagestream.engine``."""
    bad = []
    for package in ("engine", "producer", "worker", "kernels", "tests", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                        if n.split(".")[0] in FORBIDDEN or n.split(".")[0] == "worker"]
    assert not bad, "\n".join(bad)


def test_packages_import_only_what_the_architecture_allows():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for module, line in imported_modules(path):
                if module in forbidden:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def _modules_after(code):
    probe = code + "\nimport sys\nprint(sorted(m for m in ('torch', 'triton', 'transformers', 'redis', 'pydantic', 'boto3') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_producer_only_install_never_loads_torch():
    loaded = _modules_after("import pagestream.producer, pagestream.producer.client.producer, pagestream.producer.protocol.schema; from pagestream import Producer")
    assert "torch" not in loaded and "transformers" not in loaded, loaded


def test_the_engine_package_loads_no_queue_libraries():
    loaded = _modules_after("import pagestream.engine, pagestream.engine.llm_engine, pagestream.engine.model_runner")
    assert "redis" not in loaded and "pydantic" not in loaded and "boto3" not in loaded, loaded


KEY_MODULE = ROOT / "producer" / "protocol" / "keys.py"


def _hand_built_keys(path):
    """String literals that start a Redis key ("ps:..."), and f-strings built on a key prefix."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ps:"):
            yield node.lineno, repr(node.value)
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.FormattedValue):
            head = node.values[0].value
            name = head.id if isinstance(head, ast.Name) else head.attr if isinstance(head, ast.Attribute) else ""
            if name == "PREFIX":
                yield node.lineno, "f-string on PREFIX"


def test_redis_key_names_are_built_in_producer_keys_only():
    assert not list(ROOT.glob("producer/**/bulk_keys.py"))
    bad = []
    for package in ("producer", "worker", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == KEY_MODULE:
                continue
            bad += [f"{path.relative_to(ROOT)}:{line} builds a key by hand: {what}" for line, what in _hand_built_keys(path)]
    assert not bad, "\n".join(bad)


# ---- no import circle inside a package -------------------------------------------------------------


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pagestream", *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere (inside functions too), leaving out the body of
    ``if TYPE_CHECKING:`` (never run)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: set[str] = set()

    def target(name: str) -> None:
        while name and name not in modules:  # pagestream.engine.config.X -> pagestream.engine.config
            name = name.rpartition(".")[0]
        if name and name != me:
            found.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                target(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                if f"{mod}.{alias.name}" in modules:
                    target(f"{mod}.{alias.name}")
                else:
                    target(mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def package_circles(package: str) -> list[set[str]]:
    paths = sorted((ROOT / package).rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    prefix = f"pagestream.{package}"
    graph = {_module_name(p): {m for m in _imports_of(p, modules) if m.startswith(prefix)} for p in paths}
    return _circles(graph)


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    """The check itself can fail: a -> b at module level, b -> c, c -> a inside a function."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_any_package():
    """Each package's modules import one another as a tree (imports inside functions count; those
    under ``if TYPE_CHECKING:`` do not): a circle means two modules that are really one, or a layer
    reaching back up."""
    bad = []
    for package in ("producer", "worker", "engine", "kernels"):
        bad += [" <-> ".join(sorted(circle)) for circle in package_circles(package)]
    assert not bad, "import circles:\n" + "\n".join(bad)

# ---- the Redis hashes: one module each names their fields ------------------------------------------

PROTOCOL = ROOT / "producer" / "protocol"
#: Redis hash commands whose arguments after the key are field names (HSET's values are skipped below)
_HASH_COMMANDS = {"hget", "hmget", "hset", "hsetnx", "hincrby", "hincrbyfloat", "hdel", "hexists"}


def _hash_field_names() -> set[str]:
    from pagestream.producer.protocol import bulk, job

    return set(job.FIELDS) | set(bulk.FIELDS)


def _spelled_fields(path, fields):
    """Field names spelled as literals where a hash is touched: the field arguments and ``mapping=``
    keys of HGET/HMGET/HSET/HSETNX/HINCRBY/HDEL calls, the keys of a dict handed to them, and
    quoted names inside Lua (a string that calls redis.call/pcall)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "redis.call" in node.value:
            for f in fields:
                if f"'{f}'" in node.value or f'"{f}"' in node.value:
                    yield node.lineno, f"Lua names {f!r}"
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if "redis.call" in text:
                for f in fields:
                    if f"'{f}'" in text:
                        yield node.lineno, f"Lua names {f!r}"
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _HASH_COMMANDS):
            continue
        args = node.args[1:]  # the first is the key
        if node.func.attr == "hset" and len(args) == 2:
            args = args[:1]  # HSET key field value
        if node.func.attr in ("hsetnx", "hincrby", "hincrbyfloat"):
            args = args[:1]
        values = [*args, *(kw.value for kw in node.keywords if kw.arg in ("mapping", "keys", "key"))]
        for v in values:
            items = v.elts if isinstance(v, (ast.List, ast.Tuple)) else v.keys if isinstance(v, ast.Dict) else [v]
            for item in items:
                if isinstance(item, ast.Constant) and item.value in fields:
                    yield node.lineno, f"{node.func.attr} names {item.value!r}"


def test_hash_fields_are_named_in_their_protocol_module_only():
    """The job hash's and the bulk hash's fields are spelled in producer/protocol/job.py and bulk.py alone;
    everything else uses their JobField/BulkField names and scripts."""
    fields = _hash_field_names()
    assert {"status", "cancel_requested", "entry_id", "result", "deliveries", "submitted", "spec"} <= fields
    bad = []
    for package in ("producer", "worker", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(PROTOCOL):
                continue
            bad += [f"{path.relative_to(ROOT)}:{line} {what}" for line, what in _spelled_fields(path, fields)]
    assert not bad, "\n".join(bad)


def test_the_field_check_catches_a_hand_spelled_field(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("pipe.hset(jh, mapping={'status': 'running'})\nr.hget(k, 'cancel_requested')\n"
                      "LUA = \"redis.call('HGET', KEYS[1], 'entry_id')\"\nr.hset(k, 'x', 'status')\n")
    found = [what for _, what in _spelled_fields(sample, _hash_field_names())]
    assert found == ["hset names 'status'", "hget names 'cancel_requested'", "Lua names 'entry_id'"] or \
        sorted(found) == sorted(["hset names 'status'", "hget names 'cancel_requested'", "Lua names 'entry_id'"])


#: the top of the house: commands that mount the producer's CLIs beside the worker's
_WORKER_MAY_IMPORT_ALL_OF_PRODUCER = {"cli.py", "serve_cli.py", "demo.py"}
_WORKER_MAY_IMPORT = ("pagestream.producer.protocol", "pagestream.producer.bulk.storage", "pagestream.producer.bulk.s3",
                      "pagestream.producer.bulk.stores", "pagestream.producer.bulk.parts")


def test_the_worker_imports_only_the_contract_and_the_bulk_storage():
    bad = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        if path.name in _WORKER_MAY_IMPORT_ALL_OF_PRODUCER:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if isinstance(node, ast.ImportFrom) and node.module == "pagestream.producer":
                names = [f"pagestream.producer.{a.name}" for a in node.names]
            for n in names:
                if (n == "pagestream.producer" or n.startswith("pagestream.producer.")) and \
                        not any(n == ok or n.startswith(ok + ".") for ok in _WORKER_MAY_IMPORT):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {n}")
    assert not bad, "\n".join(bad)


def test_the_three_engines_satisfy_the_workers_engine_protocol():
    """LLMEngine, EngineProcess and FakeEngine have every method the worker calls (worker/engine_api.py)."""
    import inspect

    from pagestream.engine.engine_process import EngineProcess
    from pagestream.engine.llm_engine import LLMEngine
    from pagestream.worker.engine_api import Engine
    from pagestream.worker.fake_engine import FakeEngine

    assert isinstance(FakeEngine(), Engine)
    wanted = {n for n, v in vars(Engine).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert {"add_request", "step", "abort_request", "num_admittable"} <= wanted
    for cls in (LLMEngine, EngineProcess, FakeEngine):
        missing = sorted(n for n in wanted if not callable(getattr(cls, n, None)))
        assert not missing, f"{cls.__name__} lacks {missing}"
        params = inspect.signature(cls.add_request).parameters
        assert {"prompt", "params", "prompt_token_ids", "resume_token_ids", "priority"} <= set(params), cls


SHADOW_PROBE = """
import importlib.metadata, importlib.util, json, os, sys
root = os.path.realpath(sys.argv[1])
ours = json.loads(sys.argv[2])
owners = importlib.metadata.packages_distributions()
bad = []
for name in ours:
    if name not in owners:
        continue
    spec = importlib.util.find_spec(name)
    where = spec.origin if spec.origin not in (None, "namespace") else list(spec.submodule_search_locations or [""])[0]
    mine = os.path.join(root, name)
    if os.path.realpath(where) in (mine + ".py",) or os.path.realpath(where).startswith(mine + os.sep):
        bad.append(f"`import {name}` from the checkout's root resolves to our {name}/ ({where}), "
                   f"not to the installed distribution {', '.join(sorted(set(owners[name])))}")
print(json.dumps(bad))
"""


def our_top_level_names(root: pathlib.Path = ROOT) -> list[str]:
    """The names a folder (or module) of the checkout's root answers to when the root is on sys.path."""
    names = {p.stem for p in root.glob("*.py") if p.stem.isidentifier() and p.stem != "__init__"}
    names |= {p.name for p in root.iterdir()
              if p.is_dir() and p.name.isidentifier() and any(p.rglob("*.py"))}
    return sorted(names)


def shadowed_distributions(root: pathlib.Path = ROOT) -> list[str]:
    """Run from the root as a user's `python -c` is (the root first on sys.path): which installed
    distributions' top-level names resolve to our folders instead of to them."""
    import json
    out = subprocess.run([sys.executable, "-c", SHADOW_PROBE, str(root), json.dumps(our_top_level_names(root))],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_no_top_level_folder_shadows_an_installed_distribution():
    """transformers imports Hugging Face's `kernels` whenever it is installed; with the checkout's root
    on sys.path (pytest, `make demo`, `python -c` in the root) a regular package named `kernels` there
    outranks it. Our top-level folders that share a name with a distribution must be namespace portions."""
    assert "kernels" in our_top_level_names()
    bad = shadowed_distributions()
    assert not bad, "\n".join(bad)


def test_the_shadow_guard_names_a_regular_package_that_shadows_a_distribution(tmp_path):
    """The guard itself: a root holding a regular package named like an installed distribution
    (pytest's own `_pytest`) is reported; the same folder as a namespace portion is not."""
    (tmp_path / "_pytest").mkdir()
    (tmp_path / "_pytest" / "mod.py").write_text("")
    assert shadowed_distributions(tmp_path) == []
    (tmp_path / "_pytest" / "__init__.py").write_text("")
    bad = shadowed_distributions(tmp_path)
    assert len(bad) == 1 and "_pytest/" in bad[0] and "pytest" in bad[0], bad


@pytest.mark.parametrize("how", [["-c", "import pagestream.engine.loader, transformers.integrations.hub_kernels as h; "
                                        "print(h.__name__)"],
                                 ["-m", "transformers.integrations.hub_kernels"]])
def test_transformers_loads_its_kernels_integration_from_the_checkouts_root(how):
    """What broke with transformers 5.25: with the root first on sys.path (`python -c`, `python -m`, as
    `make demo` and the processes `pagestream serve` spawns run), its `from kernels import ...` found ours."""
    out = subprocess.run([sys.executable, *how], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_wheel_lists_every_package_of_the_tree():
    """pyproject.toml names the wheel's packages one by one (the checkout is the `pagestream` root), so a new
    folder left out installs without it: `pip install .` then fails with ModuleNotFoundError on first use."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {"pagestream"} | {"pagestream." + ".".join(p.parent.relative_to(ROOT).parts)
                             for top in ("engine", "kernels", "worker", "producer") for p in (ROOT / top).rglob("*.py")
                             if "__pycache__" not in p.parts}
    assert tree - listed == set(), f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(tree - listed)}"
