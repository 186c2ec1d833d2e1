"""Tasks and objectives by name, and the user's modules (``run.plugins``) that add tasks, objectives,
samplers and filters.

A config selects a task (``task.name``), a replay sampler (``reflow.sampler``) and a replay filter
(``reflow.replay_filter``) by name. The sampler and filter tables live in ``core``
(:mod:`reflow_hpc.core.samplers`, :mod:`reflow_hpc.core.filters`); the task table lives here, below
``config``, so that validating a config sees every registered task without importing any task's
code. The built-in tasks need no registration to be valid names: ``config.BUILTIN_TASKS`` names them
and their rules are config's own section checks, so a config is judged alike whether or not
``reflow_hpc.envs`` was imported. ``reflow_hpc.envs.register_task`` files a task class here.

Objectives (``algorithm.name``) follow the same pattern: the built-in ones are named, with their
advantage estimator and default aggregation, in ``config.BUILTIN_OBJECTIVES`` and filled into the
trainer's table in one place, ``reflow_hpc/train/objectives/__init__.py``; a plugin's objective is
filed here by ``@register_objective("name")`` (a subclass of
``reflow_hpc.train.objectives.base.Objective``, whose class attributes ``advantage`` and ``loss_agg``
validation reads) and may check the keys it reads in a classmethod ``check(cfg)``.

:func:`import_plugin` is the one place the package imports a module by a name it reads at run
time. ``config.validate`` calls it for each module of ``run.plugins`` before it checks the
registered names, so every entry point that loads a config (``python -m reflow_hpc.config``,
``run``, ``submit``, the simulator, the warm start) imports the same plugins and applies the same
rules. A plugin registers with ``@register_sampler`` / ``@register_replay_filter`` (``core``),
``@register_task`` or ``@register_tool`` (``envs``; a tool the model calls by name, listed in
``task.tools``); a task of its own may check the keys it reads in a classmethod
``check(cfg, *, files)`` (``envs.Task.check``), which validation calls when the config selects it.
"""

from __future__ import annotations

import importlib
from typing import Callable

_TASKS: dict[str, type] = {}
_OBJECTIVES: dict[str, type] = {}
_TOOLS: dict[str, type] = {}


def _registrar(table: dict[str, type], kind: str, name: str) -> Callable[[type], type]:
    """The class decorator that registers a class in ``table`` as ``name`` (twice under one name is an error)."""
    def deco(cls: type) -> type:
        if name in table and table[name] is not cls:
            raise ValueError(f"{kind} {name!r} is registered twice ({table[name].__name__}, {cls.__name__})")
        cls.name = name
        table[name] = cls
        return cls
    return deco


def register_task(name: str) -> Callable[[type], type]:
    """Class decorator: make a Task subclass available as ``task.name = name``."""
    return _registrar(_TASKS, "task", name)


def task_class(name: str) -> type | None:
    """The class registered as ``name``, or None."""
    return _TASKS.get(name)


def task_names() -> list[str]:
    """Names of the registered task classes."""
    return sorted(_TASKS)


def register_objective(name: str) -> Callable[[type], type]:
    """Class decorator: make an Objective subclass available as ``algorithm.name = name``."""
    return _registrar(_OBJECTIVES, "objective", name)


def objective_class(name: str) -> type | None:
    """The plugin objective class registered as ``name``, or None."""
    return _OBJECTIVES.get(name)


def objective_names() -> list[str]:
    """Names of the objectives plugins registered."""
    return sorted(_OBJECTIVES)


def register_tool(name: str) -> Callable[[type], type]:
    """Class decorator: make a ``reflow_hpc.envs.tools.Tool`` subclass callable by the model as ``name``
    (listed in ``task.tools``)."""
    return _registrar(_TOOLS, "tool", name)


def tool_class(name: str) -> type | None:
    """The tool class registered as ``name``, or None."""
    return _TOOLS.get(name)


def tool_names() -> list[str]:
    """Names of the registered tool classes."""
    return sorted(_TOOLS)


def import_plugin(module: str) -> None:
    """Import one module of ``run.plugins`` (raises ImportError; the caller names the config key)."""
    importlib.import_module(module)
