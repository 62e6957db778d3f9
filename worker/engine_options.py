"""The engine's knobs as the worker's settings and command-line options, derived from one definition.

Each knob is a field of ``engine.config.EngineConfig`` (``knob(...)``); from that list come the
``WorkerSettings`` fields (``PAGESTREAM_<NAME>``), the ``--<name>`` options of ``pagestream worker``
and ``pagestream serve`` with their help, the ``EngineConfig`` a worker builds, and the flags ``serve``
passes to its worker. A knob left unset (None) takes the engine's default.
"""
from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Optional

import typer

from pagestream.engine.config import Knob, engine_knobs

#: what ``--help`` shows where the worker's default is not the engine's
WORKER_SHOWN_DEFAULTS = {"max_num_seqs": "512 on a GPU, 8 on the CPU"}


def value_type(knob: Knob) -> type:
    """``int`` for ``int | None``: the type a set value has."""
    args = [a for a in typing.get_args(knob.type) if a is not type(None)]
    if isinstance(knob.type, types.UnionType) or typing.get_origin(knob.type) is typing.Union:
        return args[0]
    return knob.type


def settings_fields() -> dict[str, Any]:
    """Field definitions for ``pydantic.create_model``: every knob optional, None meaning the engine's default."""
    from pydantic import Field

    return {k.name: (Optional[value_type(k)], Field(None, description=k.help)) for k in engine_knobs()}


def engine_kwargs(settings: Any) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments from the knobs ``settings`` sets."""
    return {k.name: getattr(settings, k.name) for k in engine_knobs() if getattr(settings, k.name) is not None}


def engine_flags(options: dict[str, Any]) -> list[str]:
    """The command-line flags that set ``options`` (knob name -> value, None left out) on ``pagestream worker``."""
    out: list[str] = []
    for k in engine_knobs():
        v = options.get(k.name)
        if v is None:
            continue
        if value_type(k) is bool:
            out.append(k.flag if v else f"--no-{k.flag[2:]}")
        else:
            out += [k.flag, str(v)]
    return out


def _option(k: Knob, with_env: bool) -> inspect.Parameter:
    shown = WORKER_SHOWN_DEFAULTS.get(k.name) or k.show_default or (str(k.default).lower() if isinstance(k.default, bool) else str(k.default))
    flag = f"{k.flag}/--no-{k.flag[2:]}" if value_type(k) is bool else k.flag
    env = {"envvar": f"PAGESTREAM_{k.name.upper()}", "show_envvar": True} if with_env else {}
    opt = typer.Option(None, flag, help=k.help, show_default=shown, **env)
    return inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=Optional[value_type(k)])


def with_engine_options(with_env: bool = True) -> Callable[[Callable], Callable]:
    """A typer command gets one option per engine knob; the function receives them as ``engine_options``
    (knob name -> value or None)."""

    def wrap(func: Callable) -> Callable:
        sig = inspect.signature(func)
        own = [p for p in sig.parameters.values() if p.name != "engine_options"]
        names = [k.name for k in engine_knobs()]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            options = {n: kwargs.pop(n) for n in names}
            return func(**kwargs, engine_options=options)

        command.__signature__ = sig.replace(parameters=own + [_option(k, with_env) for k in engine_knobs()])
        del command.__wrapped__  # typer reads the signature above, not func's
        return command

    return wrap
