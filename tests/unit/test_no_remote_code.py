"""No model or tokenizer is ever loaded with ``trust_remote_code``: a model directory can ship Python that
transformers or vLLM would import and run in every rank. The package's source is scanned for any way of
turning it on, and the policy loader is watched while it loads a policy."""

from __future__ import annotations

import ast

import pytest

from conftest import ROOT

NAME = "trust_remote_code"


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def remote_code_uses(source: str, filename: str = "<src>") -> list[str]:
    """Every place in ``source`` that passes or sets ``trust_remote_code`` to anything but the constant False:
    a keyword argument, a dict entry (``**{...}``), a subscript or attribute assignment, a ``setattr``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.keyword) and node.arg == NAME and not _is_false(node.value):
            found.append(f"{where}: {NAME}={ast.unparse(node.value)}")
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == NAME and not _is_false(v):
                    found.append(f"{where}: {{{NAME!r}: {ast.unparse(v)}}}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                named = (isinstance(t, ast.Attribute) and t.attr == NAME) or (
                    isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == NAME)
                if named and (node.value is None or not _is_false(node.value)):
                    found.append(f"{where}: {ast.unparse(t)} = {ast.unparse(node.value) if node.value else ''}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant) and node.args[1].value == NAME \
                and not _is_false(node.args[2]):
            found.append(f"{where}: setattr(..., {NAME!r}, {ast.unparse(node.args[2])})")
    return found


def test_the_scan_finds_every_way_of_turning_it_on():
    bad = """
AutoModel.from_pretrained(p, trust_remote_code=True)
AutoTokenizer.from_pretrained(p, trust_remote_code=flag)
EngineArgs(model=p, **{"trust_remote_code": True})
kwargs["trust_remote_code"] = 1
args.trust_remote_code = True
setattr(args, "trust_remote_code", True)
"""
    assert len(remote_code_uses(bad)) == 6
    assert remote_code_uses("AutoModel.from_pretrained(p, trust_remote_code=False)\nx = {'trust_remote_code': False}"
                            "\n'''trust_remote_code=True in a docstring is no call'''") == []


def test_no_source_file_turns_on_remote_code():
    found = []
    for path in sorted((ROOT / "reflow_hpc").rglob("*.py")):
        found += remote_code_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "trust_remote_code must stay off:\n" + "\n".join(found)


@pytest.mark.parametrize("path", ["reflow_hpc/policy.py", "reflow_hpc/rollout/vllm_engine.py",
                                  "reflow_hpc/warmstart.py"])
def test_the_model_loaders_do_not_mention_it_at_all(path):
    # Not even as False: the libraries' default (off) is what the project relies on, and a mention is
    # where a later edit would turn it on.
    assert NAME not in (ROOT / path).read_text()


def test_the_policy_loader_passes_nothing_of_the_kind(monkeypatch, policy_dir):
    transformers = pytest.importorskip("transformers")
    from reflow_hpc.policy import load_policy

    path = policy_dir            # the main job's warm-started policy (built for the session if absent)
    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained.__func__

        def spy(klass, *args, _real=real, **kwargs):
            seen.append((klass.__name__, kwargs))
            return _real(klass, *args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    model, tokenizer = load_policy(path)
    assert [name for name, _ in seen] == ["AutoModelForCausalLM", "AutoTokenizer"]
    assert all(NAME not in kwargs for _, kwargs in seen), seen
    assert all(kwargs.get("local_files_only") is True for _, kwargs in seen), seen
    assert model is not None and tokenizer is not None
