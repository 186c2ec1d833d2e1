"""docs/api.md, the public surface, against the code.

The page lists every name a user, a script, a dashboard or a batch job depends on: config keys and
their allowed values, metric names, the flags of every command, environment variables, and the
names and schemas of what a run writes to disk. These tests fail when a listed name disappears from
the code, and, where the code can list its own names (config keys, allowed values given by the
config's rules, flags, the metrics a step record carries, the replay-buffer gauges, ``REFLOW_*``
variables), when the code has a name the page lacks.

Only public names are checked, never the modules or classes behind them, so the code can be
reorganised freely:

- config keys, allowed values and flags come from the commands themselves: ``python -m
  reflow_hpc.config --reference``, the one-line error a bad ``--set`` gets, and the argparse parser
  each ``python -m`` entry point (and each console script) builds, captured when it parses;
- step-record metrics from the simulator's records (real coordinator step records through the
  runtime's own ``StepMetrics``), and the gauges from ``reflow_hpc.core.GAUGE_NAMES``;
- the HDF5 shard schema and its manifest from a real shard directory written by the storage code
  (``tests/helpers/storage_writer_proc.py``);
- every other on-disk name (run directory, checkpoints, JSON keys, event kinds and their fields) from
  the package's source: a string literal or f-string outside docstrings and comments that writes it.

Everything that imports the package runs once, in a fresh interpreter (``_probe``), so that plugins
other tests register do not leak into the allowed names.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import re
import runpy
import subprocess
import sys
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
PACKAGE = ROOT / "reflow_hpc"
SHARD_WRITER = ROOT / "tests" / "helpers" / "storage_writer_proc.py"
SIM_CONFIG = ROOT / "configs" / "sim_cpu_tiny.toml"

HOLE = "\x00"        # one variable part of a name: `<rank>` on the page, `{rank}` in an f-string
PLACEHOLDER = re.compile(r"<[^<>`]*>")

# Record fields the metrics sink adds to every line, outside the coordinator's step record.
SINK_FIELDS = {"time"}


# ------------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------------

def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` is a pipe inside a cell)."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip().replace("\\|", "|") for c in parts[1:-1]]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@dataclass
class Table:
    h2: str
    h3: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def names(self) -> list[str]:
        """The names of the first column (every backticked name in it)."""
        return [n for row in self.rows for n in backticked(row[0])]

    def column(self, name: str) -> dict[str, list[str]]:
        """First name of each row → the backticked names in column ``name``."""
        i = self.columns.index(name)
        return {backticked(row[0])[0]: backticked(row[i]) for row in self.rows if backticked(row[0])}


def parse_page(text: str) -> list[Table]:
    tables: list[Table] = []
    h2 = h3 = ""
    current: Table | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            h2, h3, current = line[3:].strip(), "", None
        elif line.startswith("### "):
            h3, current = line[4:].strip(), None
        elif line.lstrip().startswith("|"):
            cells = _cells(line)
            if current is None:
                current = Table(h2, h3, [c.lower() for c in cells])
                tables.append(current)
            elif not all(set(c) <= set("-: ") for c in cells):
                current.rows.append(cells)
        else:
            current = None
    return tables


class Page:
    def __init__(self, text: str):
        self.tables = parse_page(text)

    def under(self, h2: str) -> list[Table]:
        found = [t for t in self.tables if t.h2 == h2]
        assert found, f"docs/api.md has no tables under '## {h2}'"
        return found

    def table(self, h2: str, h3: str, first: str | None = None) -> Table:
        found = [t for t in self.tables if t.h2 == h2 and t.h3 == h3 and (first is None or t.columns[0] == first)]
        assert found, f"docs/api.md has no table under '## {h2}' / '### {h3}'" + (f" starting with '{first}'"
                                                                                   if first else "")
        return found[0]


def flag_name(token: str) -> str:
    """``--set SECTION.KEY=VALUE`` → ``--set``."""
    return token.split()[0]


def pattern_regex(name: str) -> re.Pattern:
    """A page name with placeholders as a regex over concrete names (``role/<rank>`` matches ``role/3``)."""
    parts = PLACEHOLDER.split(name)
    return re.compile("[^/]+".join(re.escape(p) for p in parts))


# ------------------------------------------------------------------------------------------------
# The source: literals and f-strings of the package, outside docstrings
# ------------------------------------------------------------------------------------------------

@dataclass
class Source:
    literals: set[str] = field(default_factory=set)
    templates: set[str] = field(default_factory=set)           # f-strings, each `{...}` as HOLE
    calls: dict[str, set[str]] = field(default_factory=dict)   # a str argument of a call → its keywords
    logged: set[str] = field(default_factory=set)              # event kinds: `log(now, "kind", ...)`
    _compiled: list | None = None

    def holed(self) -> list[tuple[str, str, bool, re.Pattern]]:
        """The f-strings with variable parts: fixed start, fixed end, whether the fixed text is only
        punctuation (``{a}.{b}``), and a regex whose groups are the variable parts."""
        if self._compiled is None:
            out = []
            for t in self.templates:
                if HOLE not in t:
                    continue
                pieces = t.split(HOLE)
                generic = not re.search(r"[A-Za-z0-9]", "".join(pieces))
                out.append((pieces[0], pieces[-1], generic, re.compile("(.+?)".join(re.escape(p) for p in pieces))))
            self._compiled = out
        return self._compiled


def _template(node: ast.JoinedStr) -> str:
    return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def scan_source(paths: list[Path]) -> Source:
    """The names the package's code writes. String statements (docstrings, bare strings) are
    documentation and left out; ``ast.walk`` meets a statement before its string, and an f-string
    before its parts."""
    src = Source()
    for path in paths:
        skip: set[int] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Constant, ast.JoinedStr)):
                skip.add(id(node.value))
            elif isinstance(node, ast.JoinedStr):
                src.templates.add(_template(node))
                skip.update(id(n) for n in ast.walk(node))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                src.literals.add(node.value)
            elif isinstance(node, ast.Call):
                words = {k.arg for k in node.keywords if k.arg}
                for a in node.args:
                    if isinstance(a, ast.Constant) and isinstance(a.value, str):
                        src.calls.setdefault(a.value, set()).update(words)
                if ("log" in _callee(node).lower() and len(node.args) >= 2 and words
                        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                    src.logged.add(node.args[1].value)
    return src


def _known(piece: str, src: Source) -> bool:
    return piece in src.literals or piece in src.templates


def _written(name: str, src: Source) -> bool:
    """A literal or f-string of the package, or an f-string whose variable parts are placeholders of the
    page or literals of the package (at most one literal when the f-string is only punctuation)."""
    if _known(name, src):
        return True
    for prefix, suffix, generic, rx in src.holed():
        if name.startswith(prefix) and name.endswith(suffix):
            m = rx.fullmatch(name)
            if not m or not all(g == HOLE or _known(g, src) for g in m.groups()):
                continue
            if not generic or sum(g != HOLE for g in m.groups()) <= 1:
                return True
    return False


def _suffixes(rest: str, src: Source) -> bool:
    """``rest`` is one or more file-name suffixes the package writes (``.open``, ``.new``, ``.tmp``)."""
    if rest in src.literals:
        return True
    return any(rest[j] == "." and rest[:j] in src.literals and _suffixes(rest[j:], src) for j in range(1, len(rest)))


def in_code(name: str, src: Source) -> bool:
    """Whether the package writes ``name`` (placeholders allowed): see :func:`_written`; or such a
    name followed by file-name suffixes (``seg-r<owner>-<index>.h5`` + ``.open``)."""
    n = PLACEHOLDER.sub(HOLE, name)
    return _written(n, src) or any(n[i] == "." and _written(n[:i], src) and _suffixes(n[i:], src)
                                   for i in range(1, len(n)))


def path_in_code(path: str, src: Source) -> bool:
    """Every part of a relative path is written by the package."""
    return all(in_code(part, src) for part in path.strip("/").split("/") if part)


def key_in_code(dotted: str, src: Source) -> bool:
    """Every level of a nested JSON key (``accounting.created``) is written by the package."""
    return all(in_code(part, src) for part in dotted.split("."))


# ------------------------------------------------------------------------------------------------
# Checks: each returns the problems it found, so that a test can also show what it catches
# ------------------------------------------------------------------------------------------------

def compare(what: str, listed: set[str], live: set[str], *, complete: bool = True) -> list[str]:
    """Names of the page gone from the code, and (``complete``) names of the code missing from the page."""
    problems = [f"{what}: `{n}` is listed in docs/api.md but gone from the code" for n in sorted(listed - live)]
    if complete:
        problems += [f"{what}: `{n}` is in the code but not in docs/api.md" for n in sorted(live - listed)]
    return problems


def check_written(what: str, names: list[str], src: Source, how=in_code) -> list[str]:
    return [f"{what}: `{n}` is listed in docs/api.md but nothing in reflow_hpc/ writes it"
            for n in names if not how(n, src)]


def check_metrics(listed: list[str], produced: set[str], src: Source, *, must_produce: list[str]) -> list[str]:
    """Every metric the step records carry is listed; every listed one is produced (``must_produce``:
    by the step records themselves) or at least written by the code."""
    patterns = [(n, pattern_regex(n)) for n in listed]
    problems = [f"metrics: `{k}` is in the step records but not in docs/api.md"
                for k in sorted(produced) if not any(rx.fullmatch(k) for _, rx in patterns)]
    for n, rx in patterns:
        if any(rx.fullmatch(k) for k in produced):
            continue
        if n in must_produce:
            problems.append(f"metrics: `{n}` is listed in docs/api.md but the step records no longer carry it")
        elif not in_code(n, src):
            problems.append(f"metrics: `{n}` is listed in docs/api.md but nothing in reflow_hpc/ writes it")
    return problems


def check_events(listed: dict[str, list[str]], src: Source) -> list[str]:
    """Each listed event is logged with at least its listed fields; every logged event is listed."""
    problems = []
    for kind, fields in listed.items():
        if kind not in src.logged:
            problems.append(f"events: `{kind}` is listed in docs/api.md but no longer logged")
            continue
        missing = set(fields) - src.calls.get(kind, set())
        problems += [f"events: `{kind}` is logged without its field `{f}`" for f in sorted(missing)]
    problems += [f"events: `{k}` is logged but not in docs/api.md" for k in sorted(src.logged - set(listed))]
    return problems


def check_flags(command: str, table: Table, parser: dict) -> list[str]:
    listed = [flag_name(n) for n in table.names()]
    flags = {n for n in listed if n.startswith("-")}
    positionals = [n for n in listed if not n.startswith("-")]
    problems = compare(command, flags, set(parser["flags"]))
    if positionals != parser["positionals"]:
        problems.append(f"{command}: positional arguments {positionals} in docs/api.md, {parser['positionals']} "
                        f"in the code")
    return problems


# ------------------------------------------------------------------------------------------------
# The probe: every import of the package, in a fresh interpreter
# ------------------------------------------------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser built")
        self.parser = parser


def _parser_of(start) -> dict:
    """The flags of the argparse parser that ``start()`` builds, captured when it parses."""
    original = argparse.ArgumentParser.parse_known_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = stop
    try:
        start()
    except _Parsed as p:
        flags, positionals = {}, []
        for a in p.parser._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            if a.option_strings:
                for opt in a.option_strings:
                    flags[opt] = {"help": a.help or "", "default": str(a.default)}
            else:
                positionals.append(a.dest.upper())
        return {"flags": flags, "positionals": positionals}
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise RuntimeError("no argparse parser was built")


def _as_main(module: str, argv: list[str]) -> tuple[int, str, str]:
    """``python -m module argv...`` in this interpreter: exit code, stdout, stderr."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [module, *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def _allowed(stderr: str, key: str) -> list[str] | None:
    """The values that the one-line config error about ``key`` says are allowed (None: no such error)."""
    for line in stderr.splitlines():
        if line.startswith(f"config error: {key} = "):
            m = re.search(r": (?:allowed|registered): (.*)$", line)
            return [v.strip() for v in m.group(1).split(",")] if m else None
    return None


def _probe(request: dict) -> dict:
    warnings.simplefilter("ignore")
    out: dict = {"reference": _as_main("reflow_hpc.config", ["--reference"])[1]}
    types = {k: v["type"] for k, v in _reference_keys(out["reference"]).items()}

    # Allowed values of the enumerated keys: the list that the error of a value outside them names.
    out["allowed"] = {}
    for key in request["enums"]:
        bogus = '["__no_such_value__"]' if types.get(key) == "list" else "__no_such_value__"
        out["allowed"][key] = _allowed(_as_main("reflow_hpc.config", ["--no-files", "--set", f"{key}={bogus}"])[2], key)

    out["cli"] = {m: _parser_of(lambda m=m: _as_main(m, [])) for m in request["modules"]}
    out["scripts"] = {}
    for script, target in request["scripts"].items():
        module, _, func = target.partition(":")
        sys.argv = [script]
        out["scripts"][script] = _parser_of(lambda: getattr(importlib.import_module(module), func)())

    out["python_names"] = {}
    for dotted in request["python_names"]:
        module, _, name = dotted.rpartition(".")
        try:
            out["python_names"][dotted] = hasattr(importlib.import_module(module), name)
        except ImportError:
            out["python_names"][dotted] = False

    from reflow_hpc.core import GAUGE_NAMES, TERMINAL_REASONS
    from reflow_hpc.sim.report import simulate
    out["gauges"], out["terminal_reasons"] = list(GAUGE_NAMES), list(TERMINAL_REASONS)
    keys, roles = set(), set()
    runs = [("reflow", ["trainer.steps=8", 'scheduler.placement_schedule=["2:1", "4:2"]', "sim.length_cap_prob=0.3"]),
            ("sync", ["trainer.steps=3"])]
    for mode, sets in runs:
        for rec in simulate(str(request["sim_config"]), mode, sets).records:
            keys.update(rec)
            roles.update(v for k, v in rec.items() if k.startswith("role/"))
    out["step_record"], out["roles"] = sorted(keys), sorted(roles)
    return out


def _reference_keys(reference: str) -> dict[str, dict]:
    """``section.key`` → {type, allowed} from ``python -m reflow_hpc.config --reference``."""
    keys, section = {}, None
    for line in reference.splitlines():
        m = re.match(r"## \[(\w+)\]", line)
        if m:
            section = m.group(1)
            continue
        cells = _cells(line) if line.startswith("| `") else []
        if section and len(cells) == 5:
            allowed = cells[3]
            choices = [v.strip() for v in allowed.split(",")] if allowed and allowed[0] not in "≥><≤" else []
            keys[f"{section}.{cells[0].strip('`')}"] = {"type": cells[1], "choices": choices}
    return keys


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------

CLI_HEADING = re.compile(r"^`python -m ([\w.]+)`$")


def _page() -> Page:
    return Page(API.read_text())


def _enums(page: Page) -> dict[str, list[str]]:
    out = {}
    for t in page.under("Config"):
        for key, values in t.column("allowed values").items():
            if values:
                out[key] = values
    return out


def _pyproject_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.fixture(scope="module")
def page() -> Page:
    return _page()


@pytest.fixture(scope="module")
def started(page, tmp_path_factory):
    """The two processes the checks read, started at once: the probe, and a writer of a real shard
    directory (40 samples in closed segments of ~20 KiB, and the manifest)."""
    commands = {CLI_HEADING.match(t.h3).group(1) for t in page.under("Command line") if CLI_HEADING.match(t.h3)}
    request = {"enums": _enums(page), "modules": sorted(commands), "scripts": _pyproject_scripts(),
               "python_names": page.table("Python names", "").names(), "sim_config": str(SIM_CONFIG)}
    tmp = tmp_path_factory.mktemp("api")
    shards = tmp / "rank00000"
    (tmp / "request.json").write_text(json.dumps(request))
    procs = {
        "probe": subprocess.Popen([sys.executable, __file__, "--probe", str(tmp / "request.json")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT),
        "shards": subprocess.Popen([sys.executable, str(SHARD_WRITER), str(shards), "--max-samples", "40",
                                    "--flush-rows", "8", "--segment-mib", "0.02", "--sleep", "0"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT),
    }
    yield procs, shards
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.communicate()


@pytest.fixture(scope="module")
def src(started) -> Source:
    return scan_source(sorted(PACKAGE.rglob("*.py")))


@pytest.fixture(scope="module")
def live(started, src) -> dict:
    """What the probe found (the source was scanned meanwhile)."""
    procs, _ = started
    out, err = procs["probe"].communicate(timeout=300)
    assert procs["probe"].returncode == 0, f"the probe failed:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def shard_dir(started) -> Path:
    procs, shards = started
    _, err = procs["shards"].communicate(timeout=120)
    assert procs["shards"].returncode == 0, f"{SHARD_WRITER.name} failed:\n{err[-3000:]}"
    return shards


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------

def test_config_keys_are_listed_and_exist(page, live):
    listed = set()
    for t in page.under("Config"):
        assert t.columns == ["key", "allowed values", "meaning"], f"config table under '{t.h3}': {t.columns}"
        for key in t.names():
            section = key.split(".", 1)[0]
            assert t.h3 == f"[{section}]", f"`{key}` is listed under '### {t.h3}'"
            listed.add(key)
    assert not (problems := compare("config", listed, set(_reference_keys(live["reference"])))), "\n".join(problems)


def test_config_allowed_values(page, live):
    reference = _reference_keys(live["reference"])
    enums = _enums(page)
    problems = []
    for key, info in reference.items():
        if info["choices"] and key not in enums:
            problems.append(f"config: `{key}` takes one of {info['choices']}, which docs/api.md does not list")
    for key, values in enums.items():
        allowed = live["allowed"].get(key)
        if allowed is None:
            problems.append(f"config: `{key}` accepts any value now; docs/api.md lists {values}")
            continue
        problems += compare(f"config `{key}` values", set(values), set(allowed))
        if reference.get(key, {}).get("choices"):
            problems += compare(f"config `{key}` choices", set(values), set(reference[key]["choices"]))
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------

STEP_TABLES = ("Step records", "Replay-buffer gauges", "Trainer statistics", "GPU telemetry", "Tool calls",
               "Evaluation records")


def test_metric_names(page, live, src):
    listed = [n for h3 in STEP_TABLES for n in page.table("Metrics", h3).names()]
    must = [n for h3 in ("Step records", "Replay-buffer gauges") for n in page.table("Metrics", h3).names()
            if n not in SINK_FIELDS]
    problems = check_metrics(listed, set(live["step_record"]), src, must_produce=must)
    problems += check_written("metrics", sorted(SINK_FIELDS & set(listed)), src)
    assert not problems, "\n".join(problems)


def test_gauge_names(page, live):
    listed = page.table("Metrics", "Replay-buffer gauges").names()
    problems = compare("replay-buffer gauges", set(listed), set(live["gauges"]))
    assert not problems, "\n".join(problems)


def test_metric_values(page, live, src):
    values = page.table("Metrics", "Values").column("values")
    problems = compare("role/<rank> values", set(values["role/<rank>"]), set(live["roles"]), complete=False)
    problems += [f"role/<rank>: the simulator's records have the role `{r}`, which docs/api.md lacks"
                 for r in sorted(set(live["roles"]) - set(values["role/<rank>"]))]
    problems += compare("mode values", set(values["mode"]), set(_reference_keys(live["reference"])["reflow.mode"]
                                                                ["choices"]))
    problems += check_written("finish_reason/<reason> values", values["finish_reason/<reason>"], src)
    assert not problems, "\n".join(problems)


def test_summary_keys(page, src):
    names = page.table("Metrics", "summary.json").names()
    assert not (problems := check_written("summary.json", names, src, key_in_code)), "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# Command line and environment
# ------------------------------------------------------------------------------------------------

def test_command_line_flags(page, live):
    problems = []
    for t in page.under("Command line"):
        m = CLI_HEADING.match(t.h3)
        if m and t.columns[0] == "flag":
            problems += check_flags(f"python -m {m.group(1)}", t, live["cli"][m.group(1)])
    assert not problems, "\n".join(problems)


def test_flag_values(page, live):
    """Values a flag takes, as the parser states them (its help text or its default)."""
    analyze = live["cli"]["reflow_hpc.analyze"]["flags"]["--what-if"]["help"]
    modes = live["cli"]["reflow_hpc.sim"]["flags"]["--modes"]["default"]
    what_if = page.table("Command line", "`python -m reflow_hpc.analyze`", "name").column("values")["--what-if"]
    sim = page.table("Command line", "`python -m reflow_hpc.sim`", "name").column("values")["--modes"]
    problems = compare("--what-if keys", set(what_if), set(re.findall(r"\b[a-z]+\.[a-z_]+\b", analyze)))
    problems += compare("--modes values", set(sim), set(modes.split(",")))
    assert not problems, "\n".join(problems)


def test_console_scripts(page, live):
    table = page.table("Command line", "Console scripts")
    scripts = _pyproject_scripts()
    listed = table.column("runs")
    problems = compare("console scripts", set(listed), set(scripts))
    for script, runs in listed.items():
        if script not in scripts:
            continue
        if runs != [scripts[script]]:
            problems.append(f"console script `{script}` runs `{scripts[script]}`, docs/api.md says {runs}")
        module = scripts[script].partition(":")[0]
        command = page.table("Command line", f"`python -m {module}`", "flag")
        problems += check_flags(script, command, live["scripts"][script])
    for name in page.table("Command line", "Batch scripts").names():
        if not (ROOT / name).is_file():
            problems.append(f"batch script `{name}` is listed in docs/api.md but does not exist")
    assert not problems, "\n".join(problems)


def _text_files() -> list[Path]:
    return [*PACKAGE.rglob("*.py"), *(ROOT / "slurm").iterdir(), *(ROOT / "tools").iterdir()]


def test_environment_variables(page, src):
    ours = page.table("Environment variables", "Ours").names()
    found = set()
    for p in _text_files():
        if p.is_file():
            found.update(re.findall(r"\bREFLOW_[A-Z0-9_]+\b", p.read_text(errors="replace")))
    problems = compare("environment variables", set(ours), found)
    problems += check_written("environment variables", page.table("Environment variables", "Read, not ours").names(),
                              src)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# On disk
# ------------------------------------------------------------------------------------------------

PATH_TABLES = ("Run directory", "Evaluation snapshots", "Analysis output", "Checkpoint directory",
               "Node-local shard directory")
KEY_TABLES = ("Checkpoint meta.json", "Checkpoint trainer.pt", "extra/coordinator.json", "Replay index state",
              "extra/manifests.json", "topology.json", "Event log lines")


def test_on_disk_names(page, src, live):
    problems = []
    for h3 in PATH_TABLES:
        problems += check_written(h3, page.table("On disk", h3).names(), src, path_in_code)
    for h3 in KEY_TABLES:
        problems += check_written(h3, page.table("On disk", h3).names(), src, key_in_code)
    values = page.table("On disk", "Values on disk")
    for row in values.rows:
        problems += check_written("values on disk", backticked(row[0])[:1] + backticked(row[1]), src)
    problems += compare("terminal reasons (`end` events)", set(values.column("values")["end"]),
                        set(live["terminal_reasons"]))
    assert not problems, "\n".join(problems)


def test_event_log(page, src):
    events = page.table("On disk", "Events").column("fields")
    assert not (problems := check_events(events, src)), "\n".join(problems)


def test_shard_schema(page, shard_dir):
    import h5py
    import numpy as np

    d = shard_dir
    segments = sorted(d.glob("*.h5"))
    assert len(segments) >= 2, f"expected closed segments in {d}: {sorted(p.name for p in d.iterdir())}"
    problems = []
    names = page.table("On disk", "Node-local shard directory").names()
    closed = [pattern_regex(n) for n in names if n.endswith(".h5")]
    problems += [f"shard file `{p.name}` matches no name in docs/api.md" for p in segments
                 if not any(rx.fullmatch(p.name) for rx in closed)]
    if "manifest.json" not in names or not (d / "manifest.json").is_file():
        problems.append("shard directory: `manifest.json` is not both listed and written")

    datasets = page.table("On disk", "Shard datasets")
    rows = page.table("On disk", "Shard row fields")
    batches = page.table("On disk", "Shard batch fields")
    with h5py.File(segments[0], "r") as f:
        problems += compare("shard datasets", set(datasets.names()), set(f))
        for row in datasets.rows:
            name, dtype = backticked(row[0])[0], row[1]
            if name in f and dtype not in ("compound", "string") and f[name].dtype != np.dtype(dtype):
                problems.append(f"shard dataset `{name}`: dtype {f[name].dtype} in the file, {dtype} in docs/api.md")
            if name in f and "doc" not in f[name].attrs:
                problems.append(f"shard dataset `{name}` has no `doc` attribute")
        for table, ds in ((rows, "rows"), (batches, "batches")):
            fields = f[ds].dtype.fields if ds in f else {}
            problems += compare(f"shard `{ds}` fields", set(table.names()), set(fields or {}))
            for row in table.rows:
                name, dtype = backticked(row[0])[0], row[1]
                if fields and name in fields and fields[name][0] != np.dtype(dtype):
                    problems.append(f"shard `{ds}.{name}`: dtype {fields[name][0]} in the file, {dtype} in docs/api.md")
        problems += compare("shard attributes", set(page.table("On disk", "Shard attributes").names()), set(f.attrs))

    manifest = json.loads((d / "manifest.json").read_text())
    problems += compare("shard manifest", set(page.table("On disk", "Shard manifest").names()), set(manifest))
    entries = {k for s in manifest.get("segments", []) for k in s}
    problems += compare("shard manifest segments", set(page.table("On disk", "Shard manifest segments").names()),
                        entries)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# Python names
# ------------------------------------------------------------------------------------------------

def test_python_names(live):
    gone = [n for n, ok in live["python_names"].items() if not ok]
    assert not gone, f"listed in docs/api.md but no longer importable: {gone}"


# ------------------------------------------------------------------------------------------------
# The page itself, and the checks themselves
# ------------------------------------------------------------------------------------------------

def test_page_rows_name_something_and_say_what(page):
    """Every row names something in backticks and says in one line what it is."""
    bad = [f"'{t.h3 or t.h2}': {row}" for t in page.tables for row in t.rows
           if not backticked(row[0]) or not row[-1].strip() or len(row) != len(t.columns)]
    assert not bad, "rows of docs/api.md without a name, a meaning or all columns:\n" + "\n".join(bad)


def _new(before: list[str], after: list[str], name: str) -> bool:
    """The doctored check reports ``name``, which the real one did not."""
    return any(f"`{name}`" in p for p in after) and not any(f"`{name}`" in p for p in before)


def test_checks_catch_a_name_that_disappears(page, live, src):
    """Each check on a doctored copy of what the code has: the name deleted (or added) is reported."""
    keys = set(_reference_keys(live["reference"]))
    listed = {k for t in page.under("Config") for k in t.names()}
    before = compare("config", listed, keys)
    assert _new(before, compare("config", listed, keys - {"reflow.sigma"}), "reflow.sigma")
    assert _new(before, compare("config", listed, keys | {"run.new_key"}), "run.new_key")

    run = page.table("Command line", "`python -m reflow_hpc.run`", "flag")
    parser = live["cli"]["reflow_hpc.run"]
    doctored = {**parser, "flags": {k: v for k, v in parser["flags"].items() if k != "--check"}}
    assert _new(check_flags("run", run, parser), check_flags("run", run, doctored), "--check")

    gauges = set(page.table("Metrics", "Replay-buffer gauges").names())
    before = compare("gauges", gauges, set(live["gauges"]))
    assert _new(before, compare("gauges", gauges, set(live["gauges"]) - {"buffer/lost"}), "buffer/lost")

    produced = set(live["step_record"])
    must = page.table("Metrics", "Step records").names()
    metrics = [n for h3 in STEP_TABLES for n in page.table("Metrics", h3).names()]
    before = check_metrics(metrics, produced, src, must_produce=must)
    assert _new(before, check_metrics(metrics, produced - {"alpha"}, src, must_produce=must), "alpha")
    assert _new(before, check_metrics(metrics, produced | {"pool/spare"}, src, must_produce=must), "pool/spare")

    assert in_code("trainer.pt", src) and path_in_code("shards/rank<NNNNN>/", src)
    assert not in_code("trainer.pt", Source(src.literals - {"trainer.pt"}, src.templates, src.calls, src.logged))
    assert in_code("seg-r<owner>-<index>.h5.open", src) and not in_code("seg-r<owner>-<index>.h5.shut", src)
    assert key_in_code("accounting.created", src) and not key_in_code("accounting.destroyed", src)

    events = page.table("On disk", "Events").column("fields")
    before = check_events(events, src)
    no_tag = Source(src.literals, src.templates, {**src.calls, "checkpoint": src.calls["checkpoint"] - {"tag"}},
                    src.logged)
    assert _new(before, check_events(events, no_tag), "tag")
    assert _new(before, check_events(events, Source(src.literals, src.templates, src.calls, src.logged - {"sync"})),
                "sync")


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    print(json.dumps(_probe(json.loads(Path(sys.argv[2]).read_text()))))
