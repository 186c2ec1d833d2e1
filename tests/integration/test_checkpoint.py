"""Checkpoints: exact resume, atomic layout with a latest pointer, retention, crash leftovers."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch

from train_common import loss_tokens, make_batch, make_config, max_param_diff, tiny_model  # noqa: E402

from reflow_hpc.envs.tokenizer import build_char_tokenizer
from reflow_hpc.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from reflow_hpc.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup():
    cfg = make_config(steps=6, warmup_steps=1, schedule="cosine")
    base = tiny_model(0)
    batches = [make_batch(base, cfg, seed=20 + s) for s in range(4)]
    return cfg, base, batches


def test_resume_from_step_k_takes_exactly_the_uninterrupted_next_steps(tmp_path):
    cfg, base, batches = _setup()
    straight = Trainer(copy.deepcopy(base), cfg, "cpu")
    straight_metrics = [straight.train_step(b, loss_tokens(b)) for b in batches]

    first = Trainer(copy.deepcopy(base), cfg, "cpu")
    for b in batches[:2]:
        first.train_step(b, loss_tokens(b))
    index = {"samples": [{"id": 1, "state": "ready"}], "version": 2}
    path = save_checkpoint(tmp_path, first.step, model=first.model, tokenizer=build_char_tokenizer(64),
                           trainer_state=first.state_dict(), extra={"buffer_index": index, "manifest.rank0": [1, 2]})
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(5)
    expected_draws = (torch.rand(3), np.random.rand(2), random.random())
    # The process goes on drawing, then dies; a fresh one restores the saved RNG states.
    torch.rand(10)

    fresh = Trainer(tiny_model(42), cfg, "cpu")        # other initial weights, fresh optimizer
    assert max_param_diff(fresh.model, first.model) > 1e-3
    ckpt = load_checkpoint(latest_checkpoint(tmp_path), trainer=fresh)
    assert ckpt.path == path and ckpt.step == 2 and fresh.step == 2
    assert ckpt.extra == {"buffer_index": index, "manifest.rank0": [1, 2]}
    resumed_metrics = [fresh.train_step(b, loss_tokens(b)) for b in batches[2:]]
    for (n, p), (_, q) in zip(straight.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(p, q), n
    for m, r in zip(resumed_metrics, straight_metrics[2:]):
        assert m["lr"] == r["lr"] and m["loss"] == r["loss"] and m["grad_norm"] == r["grad_norm"]
    assert fresh.lr == straight.lr

    # RNG states as they were when the checkpoint was written.
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(5)
    save_checkpoint(tmp_path / "rng", 0, model=first.model, trainer_state=first.state_dict())
    torch.rand(5), np.random.rand(5), random.random()
    load_checkpoint(tmp_path / "rng" / "step_000000")
    draws = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(draws[0], expected_draws[0]) and np.array_equal(draws[1], expected_draws[1])
    assert draws[2] == expected_draws[2]


def test_layout_is_a_hugging_face_directory_plus_trainer_state(tmp_path):
    from reflow_hpc.policy import load_policy
    cfg, base, _ = _setup()
    tr = Trainer(copy.deepcopy(base), cfg, "cpu")
    path = save_checkpoint(tmp_path, 10, model=tr.model, tokenizer=build_char_tokenizer(64),
                           trainer_state=tr.state_dict(), extra={"a": 1})
    assert path.name == "step_000010" and (tmp_path / "latest").read_text().strip() == "step_000010"
    names = {p.name for p in (path / "model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert json.loads((path / "meta.json").read_text())["step"] == 10
    assert json.loads((path / "extra" / "a.json").read_text()) == 1
    model, tok = load_policy(path / "model")                         # a standard HF directory
    assert max_param_diff(model, tr.model) == 0 and len(tok) == len(build_char_tokenizer(64))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_latest_pointer_retention_and_crash_leftovers(tmp_path):
    cfg, base, _ = _setup()
    tr = Trainer(copy.deepcopy(base), cfg, "cpu")
    state = tr.state_dict()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=tr.model, trainer_state=state, keep_last=2, fsync=False)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"

    # A save that died half-way, and a step directory without meta.json, are never taken for checkpoints.
    (tmp_path / ".step_000004.tmp-999" / "model").mkdir(parents=True)
    (tmp_path / "step_000005").mkdir()
    (tmp_path / "step_000005" / "trainer.pt").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"      # newest complete directory
    (tmp_path / "latest").write_text("step_000009\n")                   # points at a directory that is gone
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"

    # The next save cleans the leftovers; saving a step again replaces it.
    save_checkpoint(tmp_path, 3, model=tr.model, trainer_state=state, extra={"again": True}, keep_last=2)
    assert not (tmp_path / ".step_000004.tmp-999").exists()
    assert load_checkpoint(tmp_path / "step_000003", restore_rng=False).extra == {"again": True}
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_load_errors_name_the_problem(tmp_path):
    cfg, base, _ = _setup()
    tr = Trainer(copy.deepcopy(base), cfg, "cpu")
    path = save_checkpoint(tmp_path, 1, model=tr.model, trainer_state=tr.state_dict(), fsync=False)
    with pytest.raises(FileNotFoundError, match="step_000007: no such directory"):
        load_checkpoint(tmp_path / "step_000007")
    with pytest.raises(ValueError, match="model.embed_tokens.weight has shape"):
        load_checkpoint(path, model=tiny_model(0, hidden=32), restore_rng=False)
    with pytest.raises(ValueError, match="extra key 'a/b'"):
        save_checkpoint(tmp_path, 2, model=tr.model, trainer_state=tr.state_dict(), extra={"a/b": 1})


def test_resume_refuses_a_config_the_checkpoint_is_not_laid_out_by(tmp_path):
    from conftest import python_m
    from reflow_hpc import config as C
    from reflow_hpc.train.checkpoint import resume_changes

    overrides = ["model.warmstart=true", f"run.output_dir={tmp_path}", "run.name=r"]
    cfg = C.load(None, overrides)
    step = tmp_path / "r" / "checkpoints" / "step_000004"
    (step / "extra").mkdir(parents=True)
    (step / "extra" / "config.json").write_text(json.dumps(C.to_dict(cfg)))
    (step / "meta.json").write_text(json.dumps({"step": 4, "extra": ["config"], "format": 1}))
    now = C.to_dict(C.load(None, overrides + ["algorithm.group_size=4", "trainer.lr=3e-4", "task.max_terms=5",
                                              "algorithm.name=rloo"]))
    fixed, free = resume_changes(step, now)
    assert [k for k, _, _ in fixed] == ["algorithm.group_size", "algorithm.name", "task.max_terms"]
    assert free == [("trainer.lr", cfg.trainer.lr, 3e-4)]
    (tmp_path / "run.toml").write_text("")
    r = python_m("reflow_hpc.run", str(tmp_path / "run.toml"), "--set", "model.warmstart=true",
                 "--set", f"run.output_dir={tmp_path}",
                 "--set", "run.name=r", "--set", "algorithm.group_size=4")
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("config error: algorithm.group_size = 4: the checkpoint this run resumes") and \
        "step_000004" in line and "was written with 8" in line, r.stderr
