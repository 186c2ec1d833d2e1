"""ppo's critic in a real trainer (tiny Qwen3, one process): micro-batches equal one batch (whitening included),
the warm-up freezes the policy, checkpoints restore the critic exactly, a checkpoint without a critic starts
a fresh one, weight sync sends only the policy, and the KL goes into the reward when asked."""

from __future__ import annotations

import copy

import pytest
import torch

from train_common import loss_tokens, make_batch, make_config, tiny_model  # noqa: E402

from reflow_hpc.envs.tokenizer import build_char_tokenizer
from reflow_hpc.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from reflow_hpc.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def ppo_config(**critic):
    cfg = make_config(steps=8)
    cfg.algorithm.name = "ppo"
    cfg.algorithm.gae_lambda = 0.95
    for k, v in critic.items():
        setattr(cfg.critic, k, v)
    return cfg


def batches(base, cfg, n=4):
    out = [make_batch(base, cfg, seed=30 + s, groups=3) for s in range(n)]
    for b in out:
        for it in b:
            it.advantage = 0.0              # what the coordinator's "none" estimator gives
    return out


def critic_params(trainer):
    return {n: p.detach().clone() for n, p in trainer.critic.model.named_parameters()}


def equal_state(a, b):
    sa, sb = dict(a.state_tensors()), dict(b.state_tensors())
    assert list(sa) == list(sb)
    return [n for n in sa if not torch.equal(sa[n], sb[n])]


def test_micro_batches_and_batch_wide_whitening_equal_one_batch():
    cfg = ppo_config()
    base = tiny_model(0).double()
    bs = batches(base, cfg, 2)
    whole = copy.deepcopy(cfg)
    whole.trainer.micro_batch_size = 12
    split = copy.deepcopy(cfg)
    split.trainer.micro_batch_size = 2
    one, many = Trainer(copy.deepcopy(base), whole, "cpu"), Trainer(copy.deepcopy(base), split, "cpu")
    for b in bs:
        m1, m2 = one.train_step(b, loss_tokens(b)), many.train_step(b, loss_tokens(b))
        for k in ("loss", "grad_norm", "critic/value_loss", "critic/grad_norm", "critic/explained_var"):
            assert m1[k] == pytest.approx(m2[k], rel=1e-9, abs=1e-12), k
    for (n, p), (_, q) in zip(one.state_tensors(), many.state_tensors()):
        assert torch.allclose(p, q, atol=1e-10, rtol=0), n


def test_critic_warmup_trains_only_the_critic():
    cfg = ppo_config(warmup_steps=2)
    base = tiny_model(0)
    t = Trainer(copy.deepcopy(base), cfg, "cpu")
    start = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    c0 = critic_params(t)
    bs = batches(base, cfg, 3)
    ms = [t.train_step(b, loss_tokens(b)) for b in bs[:2]]
    assert [m["critic/policy_frozen"] for m in ms] == [1.0, 1.0]
    assert all(m["loss"] == 0 and m["grad_norm"] == 0 and m["loss_tokens"] == loss_tokens(b) for m, b in zip(ms, bs))
    assert all(torch.equal(p, start[n]) for n, p in t.model.named_parameters())
    assert any(not torch.equal(p, c0[n]) for n, p in t.critic.model.named_parameters())
    assert t.scheduler.last_epoch == 0 and t.critic.scheduler.last_epoch == 2
    m = t.train_step(bs[2], loss_tokens(bs[2]))
    assert m["critic/policy_frozen"] == 0.0 and m["grad_norm"] > 0
    assert any(not torch.equal(p, start[n]) for n, p in t.model.named_parameters())


def test_checkpoint_restores_the_critic_and_the_next_steps_are_exact(tmp_path):
    cfg = ppo_config(warmup_steps=1, schedule="cosine", lr_warmup_steps=1)
    base = tiny_model(0)
    bs = batches(base, cfg, 4)
    straight = Trainer(copy.deepcopy(base), cfg, "cpu")
    want = [straight.train_step(b, loss_tokens(b)) for b in bs]
    first = Trainer(copy.deepcopy(base), cfg, "cpu")
    for b in bs[:2]:
        first.train_step(b, loss_tokens(b))
    before = [(n, t.clone()) for n, t in first.state_tensors()]
    save_checkpoint(tmp_path, first.step, model=first.model, tokenizer=build_char_tokenizer(64),
                    trainer_state=first.state_dict())
    fresh = Trainer(tiny_model(7), cfg, "cpu")          # other weights, another critic, fresh optimizers
    assert equal_state(fresh, first)
    load_checkpoint(latest_checkpoint(tmp_path), trainer=fresh)
    assert not equal_state(fresh, first)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before, fresh.state_tensors()))
    assert fresh.critic.step == 2 and fresh.critic.scheduler.state_dict() == first.critic.scheduler.state_dict()
    got = [fresh.train_step(b, loss_tokens(b)) for b in bs[2:]]
    assert not equal_state(fresh, straight)
    for m, w in zip(got, want[2:]):
        for k in ("loss", "critic/value_loss", "critic/grad_norm", "critic/lr", "critic/step"):
            assert m[k] == w[k], k


def test_a_checkpoint_without_a_critic_starts_a_fresh_one(tmp_path, capsys):
    grpo = make_config(steps=8)
    base = tiny_model(0)
    bs = batches(base, grpo, 2)
    g = Trainer(copy.deepcopy(base), grpo, "cpu")
    g.train_step(bs[0], loss_tokens(bs[0]))
    save_checkpoint(tmp_path, g.step, model=g.model, trainer_state=g.state_dict())
    ppo = Trainer(copy.deepcopy(base), ppo_config(warmup_steps=1), "cpu")
    c0 = critic_params(ppo)
    load_checkpoint(latest_checkpoint(tmp_path), trainer=ppo)
    assert "the checkpoint holds no critic" in capsys.readouterr().out
    assert ppo.step == 1 and ppo.critic.step == 0 and ppo.critic.policy_frozen
    assert all(torch.equal(p, c0[n]) for n, p in ppo.critic.model.named_parameters())
    m = ppo.train_step(bs[1], loss_tokens(bs[1]))
    assert m["critic/policy_frozen"] == 1.0 and m["critic/step"] == 1.0     # it warms up again
    # The other way: a ppo checkpoint resumed by grpo ignores the critic.
    save_checkpoint(tmp_path, 5, model=ppo.model, trainer_state=ppo.state_dict())
    g2 = Trainer(copy.deepcopy(base), grpo, "cpu")
    load_checkpoint(latest_checkpoint(tmp_path), trainer=g2)
    assert g2.step == 2 and g2.critic is None


def test_weight_sync_sends_only_the_policy_and_the_replica_state_holds_the_critic():
    base = tiny_model(0)
    t = Trainer(copy.deepcopy(base), ppo_config(), "cpu")
    sent = [n for n, _ in t.named_weights()]
    assert sent == [n for n, _ in base.named_parameters()]
    names = [n for n, _ in t.state_tensors()]
    critic = [n for n in names if n.startswith("critic/")]
    assert "critic/value_head.weight" in critic and "critic/value_head.weight.exp_avg_sq" in critic
    assert len(critic) == 4 * len(list(t.critic.model.parameters()))
    # The critic starts as the policy's body: same tensors, another module.
    body = dict(t.critic.model.model.named_parameters())
    for n, p in base.model.named_parameters():
        assert torch.equal(body[n], p) and body[n].data_ptr() != p.data_ptr()
    assert float(t.critic.model.value_head.weight.detach().abs().max()) < 0.01


def test_kl_in_the_reward_replaces_the_kl_in_the_loss():
    cfg = ppo_config()
    cfg.algorithm.kl_coef, cfg.algorithm.kl_in_reward = 0.5, True
    base = tiny_model(0)
    bs = batches(base, cfg, 1)
    t = Trainer(copy.deepcopy(base), cfg, "cpu", ref_model=tiny_model(3))
    m = t.train_step(bs[0], loss_tokens(bs[0]))
    assert m["kl"] == 0.0 and m["critic/kl_reward"] > 0
    cfg.algorithm.kl_in_reward = False
    t = Trainer(copy.deepcopy(base), cfg, "cpu", ref_model=tiny_model(3))
    m = t.train_step(bs[0], loss_tokens(bs[0]))
    assert m["kl"] > 0 and m["critic/kl_reward"] == 0.0
