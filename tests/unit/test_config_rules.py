"""Where a config's rules live and who applies them: every rule is config's own (reflow_hpc/config.py),
so a config is judged alike whatever a process imported, and every entry point that loads one gives
the same one-line error; tasks, samplers and filters of plugins (run.plugins) are seen everywhere."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from reflow_hpc import config as C
from reflow_hpc import envs, plugins
from conftest import ROOT, run_cmd

PLUGIN = textwrap.dedent('''
    """A user's plugin: a task with a rule of its own, a replay sampler and a replay filter."""
    from reflow_hpc.config import ConfigError
    from reflow_hpc.core.filters import AcceptAll, register_replay_filter
    from reflow_hpc.core.samplers import RandomSampler, register_sampler
    from reflow_hpc.envs import register_task
    from reflow_hpc.envs.arithmetic import Arithmetic


    @register_task("plugin_task")
    class PluginTask(Arithmetic):
        @classmethod
        def check(cls, cfg, *, files):
            if cfg.task.max_turns < 2:
                raise ConfigError("task.max_turns", cfg.task.max_turns, "plugin_task needs at least 2")


    @register_sampler("plugin_sampler")
    class PluginSampler(RandomSampler):
        pass


    @register_replay_filter("plugin_filter")
    class PluginFilter(AcceptAll):
        pass
''')

# (overrides, the one line every entry point must print). The messages are those the run printed
# before the rules moved into config.
BAD = [
    (["task.name=chess"], 'config error: task.name = "chess": allowed: arithmetic, calculator_tool, code_apps, code_humaneval, code_synth, math_boxed, retool'),
    (["task.min_terms=5", "task.max_terms=3"], "config error: task.min_terms = 5: must be ≤ task.max_terms (3)"),
    (["rollout.max_model_len=1"], "config error: rollout.max_model_len = 1: must be 0 (the model's length) or ≥ 2"),
    (["rollout.max_model_len=99999"], "config error: rollout.max_model_len = 99999: must be ≤ "
                                      "rollout.kv_budget_tokens (16384) so that one request always fits"),
    (["rollout.engine=vllm", "rollout.top_p=0.9"], "config error: rollout.top_p = 0.9: the vllm engine needs 1: "
                                                   "vLLM's log-probs are taken after top-p truncation, which the "
                                                   "trainer does not recompute"),
    (['sim.logprob_recompute_modes=["turbo"]'], 'config error: sim.logprob_recompute_modes = "turbo": allowed: '
                                                'sync, one_step_off, fully_async, reflow'),
    (["reflow.sampler=nope"], 'config error: reflow.sampler = "nope": registered: medium_reward, random, recency, reward_variance'),
    (["reflow.replay_filter=nope"], 'config error: reflow.replay_filter = "nope": registered: accept_all, '
                                    'reward_band'),
    (['run.plugins=["no_such_plugin"]'], 'config error: run.plugins = "no_such_plugin": cannot import: '
                                         "No module named 'no_such_plugin'"),
    (['run.plugins=["rules_plugin"]', "task.name=plugin_task", "task.max_turns=1"],
     "config error: task.max_turns = 1: plugin_task needs at least 2"),
    (['run.plugins=["rules_plugin"]', "reflow.sampler=plugin_samplr"],
     'config error: reflow.sampler = "plugin_samplr": registered: medium_reward, plugin_sampler, random, recency, reward_variance'),
]
# A rule of simulated runs only: a real run has no simulated heartbeats (its own timeout may be short).
BAD_SIM = [(["sim.tick_s=500"], "config error: sim.tick_s = 500.0: must be < run.timeout_s (60.0): the simulated "
                                "heartbeats keep every worker alive")]
# Rules that read files: applied by the entry points that check files.
BAD_FILES = [
    (["task.name=math_boxed"], 'config error: data.path = "": task math_boxed needs a JSONL or parquet file of '
                               'prompts and answers'),
    (["task.name=math_boxed", "data.path=/nonexistent/rows.jsonl"],
     'config error: data.path = "/nonexistent/rows.jsonl": no such file'),
]
CONFIG = str(ROOT / "configs" / "cpu_tiny.toml")
# Every entry point that loads a config, as (module whose main() takes argv, argv before the config).
# A case that passed by mistake must do no harm: the run only self-checks and finds no launcher, the
# submission is a dry run, the warm start makes no step and writes under tmp (see _entry_points).
ENTRY_POINTS = {
    "config": ("reflow_hpc.config", []),
    "config --no-files": ("reflow_hpc.config", ["--no-files"]),
    "run": ("reflow_hpc.run", ["--check"]),
    "submit --dry-run": ("reflow_hpc.submit", ["--nodes", "1", "--dry-run"]),
    "sim": ("reflow_hpc.sim.__main__", ["--modes", "reflow"]),
    "warmstart": ("reflow_hpc.warmstart", []),
}
CHECKS_FILES = {"config", "run"}
SAFE = ["model.warmstart=true", "run.mpiexec=no-such-mpiexec", "warmstart.steps=0", "warmstart.eval_prompts=0"]

# In a fresh interpreter that imports only the entry point's module: main(argv) for every case, its
# exit code and what it printed on stderr.
DRIVER = textwrap.dedent('''
    import contextlib, importlib, io, json, sys
    module, cases = sys.argv[1], json.loads(sys.argv[2])
    main = importlib.import_module(module).main
    out = []
    for argv in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        out.append([code, [ln for ln in err.getvalue().splitlines() if ln.strip()]])
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / "rules_plugin.py").write_text(PLUGIN)
    return d


def _env(plugin_path) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}


def _argv(name: str, sets: list[str], tmp_path) -> list[str]:
    module, pre = ENTRY_POINTS[name]
    extra = ["--out", str(tmp_path / "policy")] if name == "warmstart" else []
    return [*pre, *extra, CONFIG, *[x for s in [*SAFE, *sets] for x in ("--set", s)]]


def test_every_entry_point_gives_the_same_one_line_error(plugin_path, tmp_path):
    """Each entry point in a process of its own, as a user starts it: the same bad config, the same one
    line and exit code 2 from all of them."""
    seen = {}
    for name, (module, _) in ENTRY_POINTS.items():
        cases = BAD + (BAD_FILES if name in CHECKS_FILES else []) + (BAD_SIM if name == "sim" else [])
        r = run_cmd([sys.executable, "-c", DRIVER, module, json.dumps([_argv(name, s, tmp_path) for s, _ in cases])],
                    env=_env(plugin_path), timeout=120)
        assert r.returncode == 0, r.stderr
        for (sets, want), (code, lines) in zip(cases, json.loads(r.stdout.splitlines()[-1])):
            seen[name, tuple(sets)] = (code, lines)
            assert (code, lines) == (2, [want]), f"{name} {sets}: exit {code}, stderr {lines}"
    assert len(seen) == len(ENTRY_POINTS) * len(BAD) + len(CHECKS_FILES) * len(BAD_FILES) + len(BAD_SIM)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_each_command_line_prints_one_line_and_exits_2(name, plugin_path, tmp_path):
    """The same through `python -m`, once per entry point (a case only a plugin's rule refuses)."""
    sets, want = BAD[-2]
    module, _ = ENTRY_POINTS[name]
    r = run_cmd([sys.executable, "-m", module.removesuffix(".__main__"), *_argv(name, sets, tmp_path)],
                env=_env(plugin_path), timeout=120)
    assert r.returncode == 2, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [want]


def test_the_rules_do_not_depend_on_what_a_process_imported(plugin_path):
    """A process that imported only config judges every case as one that imported the tasks, the engine
    factory and the simulator first; validating (without plugins, which import what they use) imports
    none of them."""
    code = textwrap.dedent('''
        import json, sys
        for m in sys.argv[3:]:
            __import__(m)
        import reflow_hpc.config as C
        out, seen = [], False
        for sets in json.loads(sys.argv[2]):
            if any(s.startswith("run.plugins") for s in sets) and not seen:
                seen = True
                out.append(sorted(m for m in sys.modules if m.split(".")[:2] in
                                  (["reflow_hpc", "envs"], ["reflow_hpc", "rollout"], ["reflow_hpc", "sim"])))
            try:
                C.load(sys.argv[1], ["model.warmstart=true", *sets])
                out.append("ok")
            except C.ConfigError as e:
                out.append(str(e))
        print(json.dumps(out))
    ''')
    plain = [(s, w) for s, w in BAD + BAD_FILES if not any(x.startswith("run.plugins") for x in s)]
    with_plugins = [(s, w) for s, w in BAD if any(x.startswith("run.plugins") for x in s)]
    cases = plain + [(["task.name=calculator_tool"], "ok")] + with_plugins
    argv = [sys.executable, "-c", code, CONFIG, json.dumps([s for s, _ in cases])]
    alone = run_cmd(argv, env=_env(plugin_path), timeout=120)
    after = run_cmd(argv + ["reflow_hpc.sim.workload", "reflow_hpc.rollout.factory", "reflow_hpc.envs"],
                    env=_env(plugin_path), timeout=120)
    assert alone.returncode == 0 and after.returncode == 0, alone.stderr + after.stderr
    a, b = json.loads(alone.stdout), json.loads(after.stdout)
    imported = a.pop(len(plain) + 1)
    b.pop(len(plain) + 1)
    assert a == b == [want for _, want in cases]
    assert imported == [], f"validating a config imported {imported}"


def test_a_plugin_registers_names_that_every_load_accepts(plugin_path):
    sets = ['run.plugins=["rules_plugin"]', "task.name=plugin_task", "task.max_turns=2",
            "reflow.sampler=plugin_sampler", "reflow.replay_filter=plugin_filter"]
    r = run_cmd([sys.executable, "-m", "reflow_hpc.config", CONFIG, *[x for s in sets for x in ("--set", s)]],
                env=_env(plugin_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert 'name = "plugin_task"' in r.stdout and 'sampler = "plugin_sampler"' in r.stdout


def test_the_built_in_tasks_are_those_config_names():
    """config.BUILTIN_TASKS (valid without importing envs) are exactly the tasks envs registers, and
    their rules are config's: none of them adds a check of its own, which would apply only where envs
    was imported."""
    built_in = {n for n in plugins.task_names() if plugins.task_class(n).__module__.startswith("reflow_hpc.envs.")}
    assert built_in == set(C.BUILTIN_TASKS)
    for name in C.BUILTIN_TASKS:
        assert plugins.task_class(name).check.__func__ is envs.Task.check.__func__, name
    assert set(C.DATA_TASKS) <= set(C.BUILTIN_TASKS)


def test_the_task_table_is_one_table():
    """envs registers into reflow_hpc.plugins, and make_task builds from it."""
    assert envs.register_task is plugins.register_task and envs.task_names() == plugins.task_names()
    assert type(envs.make_task(C.load(None, ["model.warmstart=true", "task.name=calculator_tool"]))) is \
        plugins.task_class("calculator_tool")
    with pytest.raises(ValueError, match="registered twice"):
        plugins.register_task("arithmetic")(type("Other", (envs.Task,), {}))
