"""Warm start end to end: a few SFT steps into a tmp dir, loadable by plain transformers."""

from __future__ import annotations

import json

import sys

import pytest
import torch

from reflow_hpc import config as C
from reflow_hpc import envs
from reflow_hpc.envs.tokenizer import build_char_tokenizer
from reflow_hpc.warmstart import IGNORE, ensure_policy, exact_match, sft_example, sft_task, warmstart
from conftest import run_cmd

pytestmark = pytest.mark.usefixtures("offline")

# A small model and a short run: the test checks the plumbing, not the final accuracy.
SMALL = ["model.warmstart=true", "model.tiny_hidden_size=64", "model.tiny_layers=2", "model.tiny_heads=4",
         "model.tiny_kv_heads=2", "model.tiny_head_dim=16", "model.tiny_intermediate_size=128",
         "warmstart.steps=30", "warmstart.batch_size=16", "warmstart.length_buckets=3",
         "warmstart.eval_prompts=24", "warmstart.eval_batch_size=24", "warmstart.max_new_tokens=48",
         "warmstart.log_every=10", "warmstart.lr=3e-3", "warmstart.warmup_steps=3",
         # One thread: on a CPU shared with other test processes, OpenMP barriers of 2 threads spin.
         "warmstart.threads=1"]


def test_sft_example_masks_prompt_and_observations():
    tok = build_char_tokenizer()
    task = envs.make_task(C.load(None, ["model.warmstart=true", "task.name=calculator_tool"]))
    p = task.prompt(0)
    ids, labels = sft_example(tok, task, p)
    n_prompt = len(tok.encode(p.text))
    assert all(lab == IGNORE for lab in labels[:n_prompt])
    assert ids[-1] == labels[-1] == tok.eos_token_id
    trained = tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE], skip_special_tokens=True)
    segs = task.solution_segments(p)
    assert trained == segs[0][0] + segs[2][0]                         # observation carries no loss
    assert tok.decode(ids, skip_special_tokens=True) == p.text + task.solution(p)


def test_sft_task_falls_back_to_arithmetic(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    cfg = C.load(None, ["model.warmstart=true", "task.name=math_boxed", f"data.path={f}", "task.eval_fraction=0"])
    assert sft_task(cfg).name == "arithmetic"
    assert sft_task(C.load(None, ["model.warmstart=true", "task.name=calculator_tool"])).name == "calculator_tool"


def test_warmstart_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = C.load(None, SMALL + [f"model.path={tmp_path / 'unused'}"])
    lines: list[str] = []
    out = tmp_path / "policy"
    res = warmstart(cfg, out=out, log=lines.append)
    assert res.path == out and (out / "config.json").is_file()
    assert not (tmp_path / "unused").exists()
    assert res.exact_match_after >= res.exact_match_before
    assert res.final_loss < 2.5                                       # it learned something (ln(104) ≈ 4.6)
    assert any("exact match" in ln for ln in lines) and any("step 30/30" in ln for ln in lines)

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    task = envs.make_task(cfg)
    held = [task.prompt(i, "eval") for i in range(24)]
    again = exact_match(model, tok, task, held, 48, 24)
    assert again == pytest.approx(res.exact_match_after)              # the saved model is the measured one


def test_warmstart_is_deterministic(tmp_path):
    cfg = C.load(None, SMALL + ["warmstart.steps=6", "warmstart.eval_prompts=0"])
    a = warmstart(cfg, out=tmp_path / "a", log=lambda s: None)
    b = warmstart(cfg, out=tmp_path / "b", log=lambda s: None)
    assert a.final_loss == b.final_loss
    from safetensors.torch import load_file
    sa, sb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_ensure_policy(tmp_path):
    path = tmp_path / "model"
    with pytest.raises(C.ConfigError) as e:
        ensure_policy(C.load(None, [f"model.path={path}"], check_files=False))
    assert str(e.value).startswith("config error: model.path")
    cfg = C.load(None, SMALL + [f"model.path={path}", "warmstart.steps=2", "warmstart.eval_prompts=0"])
    assert ensure_policy(cfg, log=lambda s: None) == path
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_policy(cfg, log=lambda s: None) == path            # exists now: no second warm start
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_command_line(tmp_path):
    out = tmp_path / "cli"
    args = [a for s in SMALL + ["warmstart.steps=4", "warmstart.eval_prompts=8"] for a in ("--set", s)]
    r = run_cmd([sys.executable, "-m", "reflow_hpc.warmstart", *args, "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "exact match" in r.stdout and (out / "model.safetensors").is_file()
    bad = run_cmd([sys.executable, "-m", "reflow_hpc.warmstart", "--set", "warmstart.steps=-1"], timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("config error: warmstart.steps")


def test_a_policy_warm_started_with_other_settings_is_refused(tmp_path):
    path = tmp_path / "policy"
    cfg = C.load(None, SMALL + ["warmstart.steps=2", "warmstart.eval_prompts=0", f"model.path={path}"])
    assert ensure_policy(cfg, log=lambda s: None) == path and (path / "reflow_warmstart.json").is_file()
    same = C.load(None, SMALL + ["warmstart.steps=2", "warmstart.eval_prompts=7", "warmstart.log_every=1",
                                f"model.path={path}"])
    assert ensure_policy(same, log=lambda s: None) == path          # what is only printed may differ
    other = C.load(None, SMALL + ["warmstart.steps=3", "task.max_terms=5", f"model.path={path}"])
    with pytest.raises(C.ConfigError) as e:
        ensure_policy(other, log=lambda s: None)
    assert e.value.key == "model.path" and "task.max_terms, warmstart.steps differ" in str(e.value)
    as_is = C.load(None, SMALL[1:] + ["model.warmstart=false", "warmstart.steps=3", f"model.path={path}"])
    assert ensure_policy(as_is, log=lambda s: None) == path          # used as it is, no recipe check
    # A recipe saved before a task key existed: the key counts at its default, not as a change.
    recipe_file = path / "reflow_warmstart.json"
    saved = json.loads(recipe_file.read_text())
    del saved["task"]["max_terms"]
    recipe_file.write_text(json.dumps(saved))
    assert ensure_policy(same, log=lambda s: None) == path
    with pytest.raises(C.ConfigError, match="task.max_terms"):
        ensure_policy(C.load(None, SMALL + ["warmstart.steps=2", "task.max_terms=5", f"model.path={path}"]),
                      log=lambda s: None)
