"""One trainer replica on a real tiny Qwen3: micro-batching, metrics, checks, offload, engine log-probs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from train_common import loss_tokens, make_batch, make_config, max_param_diff, tiny_model  # noqa: E402

from reflow_hpc.rollout.engine import Request, SamplingParams
from reflow_hpc.rollout.torch_engine import TorchEngine
from reflow_hpc.train.trainer import WeightedSample, Trainer
from reflow_hpc.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_thread")

METRICS = {"loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio/mean", "ratio/max", "approx_kl",
           "advantages/mean", "weights/mean", "samples", "replay_samples", "tokens", "loss_tokens", "lr",
           "grad_norm", "nonfinite_grad", "step", "seconds", "forward_backward_seconds", "allreduce_seconds",
           "optimizer_seconds", "rollout_is/mean", "rollout_is/max", "rollout_is/capped_fraction"}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 5e-5)])
def test_micro_batch_size_and_token_cap_do_not_change_the_update(dtype, tol):
    cfg = make_config(warmup_steps=2)
    base = tiny_model(0).to(dtype)
    items = make_batch(base, cfg, seed=1)
    n = loss_tokens(items)
    finals = []
    for mbs, tokens in ((1, 0), (3, 0), (8, 0), (8, 3 * max(len(it.trajectory.tokens) for it in items))):
        cfg.trainer.micro_batch_size, cfg.trainer.micro_batch_tokens = mbs, tokens
        model = copy.deepcopy(base)
        tr = Trainer(model, cfg, "cpu")
        metrics = [tr.train_step(items, n) for _ in range(2)]
        finals.append((model, metrics))
    for model, metrics in finals[1:]:
        # In float32 different padding widths round differently and Adam magnifies that on elements
        # with gradients near its ε; a normalisation bug would show at the lr scale (1e-3).
        assert max_param_diff(model, finals[0][0]) < tol
        for key in ("loss", "grad_norm", "clip_fraction", "ratio/mean", "entropy"):
            assert metrics[-1][key] == pytest.approx(finals[0][1][-1][key], rel=1e-4, abs=1e-7), key
    assert max_param_diff(finals[0][0], base) > 1e-5     # the steps did move the weights


@pytest.mark.parametrize("name, agg", [("dr_grpo", "auto"), ("gspo", "auto"), ("cispo", "auto"),
                                       ("rloo", "seq_mean_token_mean"), ("dapo", "seq_mean_token_sum")])
def test_every_objective_and_aggregation_is_independent_of_the_micro_batch_size(name, agg):
    cfg = make_config()
    cfg.algorithm.name, cfg.algorithm.loss_agg, cfg.algorithm.is_cap = name, agg, 2.0
    base = tiny_model(0).to(torch.float64)
    items = make_batch(base, cfg, seed=3)
    n = loss_tokens(items)
    models = []
    for mbs in (1, 8):
        cfg.trainer.micro_batch_size = mbs
        model = copy.deepcopy(base)
        Trainer(model, cfg, "cpu").train_step(items, n, len(items))
        models.append(model)
    assert max_param_diff(models[0], models[1]) < 1e-12
    assert max_param_diff(models[0], base) > 1e-5
    cfg.algorithm.loss_agg = "seq_mean_token_mean"
    with pytest.raises(ValueError, match="batch_samples = 9, but the batch holds 8 samples"):
        Trainer(copy.deepcopy(base), cfg, "cpu").train_step(items, n, 9)


def test_metrics_names_counts_and_lr():
    cfg = make_config(warmup_steps=4)
    model = tiny_model(0)
    items = make_batch(model, cfg, seed=2, replay=3)
    tr = Trainer(model, cfg, "cpu")
    m1 = tr.train_step(items, loss_tokens(items))
    m2 = tr.train_step(items, loss_tokens(items))
    assert set(m1) == METRICS
    assert m1["lr"] == pytest.approx(cfg.trainer.lr / 4) and m2["lr"] == pytest.approx(cfg.trainer.lr / 2)
    assert m1["step"] == 1 and m2["step"] == 2 and tr.step == 2
    assert m1["samples"] == len(items) and m1["replay_samples"] == 3
    assert m1["tokens"] == sum(len(it.trajectory.tokens) for it in items)
    assert m1["loss_tokens"] == loss_tokens(items)
    assert m1["weights/mean"] == pytest.approx(np.mean([it.weight for it in items]), rel=1e-6)
    assert 0 < m1["clip_fraction"] < 1 and m1["grad_norm"] > 0 and m1["nonfinite_grad"] == 0
    assert m1["kl"] == 0.0 and 0 < m1["entropy"] <= np.log(model.config.vocab_size) + 1e-6


def test_bad_inputs_fail_with_one_clear_line():
    cfg = make_config()
    model = tiny_model(0)
    items = make_batch(model, cfg, seed=3)
    tr = Trainer(model, cfg, "cpu")
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"batch_loss_tokens = 5, but the samples of the batch carry \d+ loss tokens"):
        tr.train_step(items, 5)
    assert max_param_diff(model, before) == 0 and tr.step == 0      # nothing was applied
    t = items[0].trajectory
    bad = Trajectory(99, 0, 0, t.tokens, t.logprobs, np.where(np.arange(len(t.tokens)) == 0, 1, t.versions),
                     t.prompt_len)
    with pytest.raises(ValueError, match="sample 99: its first token is marked generated"):
        tr.train_step([WeightedSample(bad, 1.0, 1.0)], 10)
    big = Trajectory(98, 0, 0, np.append(t.tokens, 10_000), np.append(t.logprobs, 0), np.append(t.versions, 0),
                     t.prompt_len)
    with pytest.raises(ValueError, match="sample 98: token ids outside the vocabulary"):
        tr.train_step([WeightedSample(big, 1.0, 1.0)], 10)
    with pytest.raises(ValueError, match="sample .*: advantage nan"):
        tr.train_step([WeightedSample(t, float("nan"), 1.0)], t.num_loss_tokens)
    cfg.algorithm.kl_coef = 0.1
    with pytest.raises(ValueError, match="algorithm.kl_coef = 0.1: a reference model is needed"):
        Trainer(tiny_model(0), cfg, "cpu")


def test_nonfinite_gradient_skips_the_update():
    cfg = make_config()
    model = tiny_model(0)
    items = make_batch(model, cfg, seed=4)
    items = [WeightedSample(it.trajectory, 3e38, it.weight, it.is_replay) for it in items]
    tr = Trainer(model, cfg, "cpu")
    before = copy.deepcopy(model)
    m = tr.train_step(items, loss_tokens(items))
    assert m["nonfinite_grad"] == 1.0 and not np.isfinite(m["grad_norm"])
    assert max_param_diff(model, before) == 0 and tr.step == 1


def test_offload_onload_on_cpu_is_called_and_checked():
    cfg = make_config()
    base = tiny_model(0)
    items = make_batch(base, cfg, seed=5)
    n = loss_tokens(items)
    plain, colocated = Trainer(copy.deepcopy(base), cfg, "cpu"), Trainer(copy.deepcopy(base), cfg, "cpu")
    for _ in range(2):
        plain.train_step(items, n)
        colocated.train_step(items, n)
        colocated.offload()
        assert colocated.offloaded
        with pytest.raises(RuntimeError, match="offloaded trainer: call onload"):
            colocated.train_step(items, n)
        colocated.onload()
    assert max_param_diff(plain.model, colocated.model) == 0


def test_kl_to_a_reference_model():
    cfg = make_config()
    cfg.algorithm.kl_coef = 0.05
    model = tiny_model(0)
    items = make_batch(model, cfg, seed=6)
    tr = Trainer(model, cfg, "cpu", ref_model=copy.deepcopy(model))
    first = tr.train_step(items, loss_tokens(items))
    second = tr.train_step(items, loss_tokens(items))
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)          # same weights as the reference
    assert second["kl"] > 0 and second["loss"] != second["pg_loss"]
    assert all(not p.requires_grad for p in tr.ref_model.parameters())


def test_recomputed_logprobs_match_the_rollout_engine():
    """Samples generated by the torch engine at temperature T: ratio 1, nothing clipped, approx_kl 0."""
    cfg = make_config()
    cfg.rollout.temperature = 0.7
    torch.manual_seed(0)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=True, initializer_range=0.1, pad_token_id=0)
    gen_model = Qwen3ForCausalLM(config)
    trainer_model = copy.deepcopy(gen_model)
    engine = TorchEngine(gen_model, max_concurrency=4, kv_budget_tokens=512, max_model_len=64, seed=7, version=2)
    rng = np.random.default_rng(0)
    for rid in range(6):
        prompt = rng.integers(3, 96, size=int(rng.integers(2, 8))).astype(np.int32)
        engine.add(Request(rid, prompt, SamplingParams(temperature=0.7, max_new_tokens=int(rng.integers(4, 16)))))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    items = []
    for c in done:
        p = len(c.prompt)
        traj = Trajectory(c.request_id, 0, 0, np.concatenate([c.prompt, c.response]),
                          np.concatenate([np.zeros(p, np.float32), c.logprobs]),
                          np.concatenate([np.full(p, -1, np.int32), c.versions]), p)
        items.append(WeightedSample(traj, 1.0 if c.request_id % 2 else -1.0, 1.0))
    tr = Trainer(trainer_model, cfg, "cpu")
    m = tr.train_step(items, loss_tokens(items))
    assert m["loss_tokens"] == sum(len(c.response) for c in done)
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["ratio/max"] == pytest.approx(1.0, abs=5e-4)
    assert m["clip_fraction"] == 0.0 and m["approx_kl"] < 1e-7
