"""GRPO loss: a hand-computed example, clipping on both sides, masking, τ weights, the ratio-1 gradient."""

from __future__ import annotations

import math

import pytest
import torch

from train_common import make_batch, make_config, tiny_model  # noqa: E402

from reflow_hpc.core.mixing import loss_weights
from reflow_hpc.train.loss import SUM_KEYS, loss_metrics, policy_loss, token_logprobs
from reflow_hpc.train.trainer import collate

CLIP_LOW, CLIP_HIGH = 0.2, 0.3


def _two_samples():
    # Sample 0 (A = +1, w = 1.2): ratios 1, e^0.4 (clipped above at 1.3), e^-0.5 (not clipped: A > 0).
    # Sample 1 (A = -0.5, w = 0.7): ratio e^-0.5 (clipped below at 0.8), 1, and a masked pad token.
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.6, -1.2, 7.0]], dtype=torch.float32, requires_grad=True)
    behaviour = torch.tensor([[-1.0, -0.9, -1.5], [-0.1, -1.2, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -0.5])
    w = torch.tensor([1.2, 0.7])
    return logp, behaviour, mask, adv, w


def test_hand_computed_example_matches_exactly():
    logp, behaviour, mask, adv, w = _two_samples()
    n_batch = 7   # the whole batch (other replicas included) holds 7 loss tokens
    loss, sums, maxima = policy_loss(logp, behaviour, mask, adv, w, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                                     batch_loss_tokens=n_batch)
    e = math.exp
    tok0 = [-1.0 * 1.0, -1.0 * 1.3, -1.0 * e(-0.5)]           # -min(r A, clip(r) A), A = 1
    tok1 = [-min(e(-0.5) * -0.5, 0.8 * -0.5), -(1.0 * -0.5)]       # A = -0.5: the lower clip binds
    assert tok1[0] == pytest.approx(0.4)
    expected = (1.2 * sum(tok0) + 0.7 * sum(tok1)) / n_batch
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)

    loss.backward()
    grad = logp.grad
    # d/dlogp of -w r A / N is -w r A / N where unclipped; 0 where the clipped term binds; 0 for pads.
    expected_grad = torch.tensor([[-1.2 * 1.0 / 7, 0.0, -1.2 * e(-0.5) / 7],
                                  [0.0, -0.7 * (-0.5) / 7, 0.0]])
    assert torch.allclose(grad, expected_grad, atol=1e-7)

    m = loss_metrics(sums, maxima)
    assert m["loss"] == pytest.approx(expected, rel=1e-6)
    assert m["pg_loss"] == pytest.approx(expected, rel=1e-6)
    assert m["clip_fraction"] == pytest.approx(2 / 5)
    assert m["ratio/max"] == pytest.approx(e(0.4), rel=1e-6)
    assert m["ratio/mean"] == pytest.approx((1 + e(0.4) + e(-0.5) + e(-0.5) + 1) / 5, rel=1e-6)
    k3 = lambda lr: e(lr) - 1 - lr
    assert m["approx_kl"] == pytest.approx((k3(0.4) + 2 * k3(-0.5)) / 5, rel=1e-5)
    assert m["advantages/mean"] == pytest.approx(0.25)
    assert m["weights/mean"] == pytest.approx(0.95)
    assert m["kl"] == 0.0
    assert dict(zip(SUM_KEYS, sums.tolist()))["loss_tokens"] == 5


def test_clipping_on_both_sides_zeroes_the_gradient_only_where_it_binds():
    ratios = torch.tensor([0.5, 0.7, 0.9, 1.0, 1.2, 1.4, 2.0])
    logp = ratios.log()[None].clone().requires_grad_(True)
    behaviour = torch.zeros_like(logp)
    mask = torch.ones_like(logp, dtype=torch.bool)
    for a, binding in ((1.0, [False, False, False, False, False, True, True]),
                       (-1.0, [True, True, False, False, False, False, False])):
        logp.grad = None
        loss, sums, maxima = policy_loss(logp, behaviour, mask, torch.tensor([a]), torch.tensor([1.0]),
                                         clip_low=CLIP_LOW, clip_high=CLIP_HIGH, batch_loss_tokens=7)
        loss.backward()
        zero = (logp.grad[0] == 0).tolist()
        assert zero == binding, (a, logp.grad)
        assert loss_metrics(sums, maxima)["clip_fraction"] == pytest.approx(sum(binding) / 7)
        # The loss value of a binding token is the clipped one.
        clipped_ratio = ratios.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
        per_token = torch.maximum(-a * ratios, -a * clipped_ratio)
        assert float(loss.detach()) == pytest.approx(float(per_token.sum() / 7), rel=1e-6)


def test_masked_tokens_contribute_nothing_even_when_extreme():
    logp, behaviour, mask, adv, w = _two_samples()
    loss, _, _ = policy_loss(logp, behaviour, mask, adv, w, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                             batch_loss_tokens=5)
    loss.backward()
    grad = logp.grad.clone()

    wild = logp.detach().clone()
    wild[1, 2] = 80.0                       # exp(80 - (-80)) would overflow to inf
    wild_behaviour = behaviour.clone()
    wild_behaviour[1, 2] = -80.0
    wild.requires_grad_(True)
    loss2, sums2, maxima2 = policy_loss(wild, wild_behaviour, mask, adv, w, clip_low=CLIP_LOW,
                                        clip_high=CLIP_HIGH, batch_loss_tokens=5)
    loss2.backward()
    assert float(loss2.detach()) == float(loss.detach())
    assert torch.equal(wild.grad, grad)
    assert torch.isfinite(sums2).all() and torch.isfinite(maxima2).all()


@pytest.mark.parametrize("tau", [0.25, 0.5])
def test_doubling_tau_doubles_the_replayed_share(tau):
    # Three unused samples and one replayed one, all with the same per-token values and ratio 1.
    lengths = [4, 6, 5, 3]
    is_replay = [False, False, False, True]

    def replay_share(t):
        w = torch.tensor(loss_weights(is_replay, lengths, t))
        width = max(lengths)
        logp = torch.full((4, width), -1.0, requires_grad=True)
        mask = torch.tensor([[c < n for c in range(width)] for n in lengths])
        loss, _, _ = policy_loss(logp, logp.detach(), mask, torch.ones(4), w, clip_low=CLIP_LOW,
                                 clip_high=CLIP_HIGH, batch_loss_tokens=sum(lengths))
        loss.backward()
        per_sample = logp.grad.abs().sum(dim=1)
        return float(per_sample[3] / per_sample.sum()), float(per_sample[3] / per_sample[0] * lengths[0] / lengths[3])

    share, per_token_ratio = replay_share(tau)
    share2, per_token_ratio2 = replay_share(2 * tau)
    n_u, n_r = sum(lengths[:3]), lengths[3]
    assert share == pytest.approx(tau * n_r / (n_u + tau * n_r), rel=1e-6)
    assert share2 == pytest.approx(2 * tau * n_r / (n_u + 2 * tau * n_r), rel=1e-6)
    # Per token, a replayed sample weighs τ times an unused one; doubling τ doubles that.
    assert per_token_ratio == pytest.approx(tau, rel=1e-6)
    assert per_token_ratio2 == pytest.approx(2 * tau, rel=1e-6)


def test_token_weighted_mean_weight_is_one_so_the_scale_does_not_depend_on_replay():
    lengths, is_replay = [4, 6, 5, 3], [False, True, False, True]
    w = torch.tensor(loss_weights(is_replay, lengths, 0.5))
    width = max(lengths)
    logp = torch.full((4, width), -1.0, requires_grad=True)
    mask = torch.tensor([[c < n for c in range(width)] for n in lengths])
    loss, _, _ = policy_loss(logp, logp.detach(), mask, torch.ones(4), w, clip_low=CLIP_LOW,
                             clip_high=CLIP_HIGH, batch_loss_tokens=sum(lengths))
    assert float(loss.detach()) == pytest.approx(-1.0, rel=1e-6)   # -A · mean ratio with A = 1, ratio = 1


def test_with_all_ratios_one_the_gradient_is_the_weighted_policy_gradient():
    cfg = make_config()
    model = tiny_model(3)
    items = make_batch(model, cfg, seed=5, noise=0.0)
    mb = collate(items, 0, torch.device("cpu"))
    n = sum(it.trajectory.num_loss_tokens for it in items)
    temp = cfg.rollout.temperature

    def grads(surrogate: bool):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                       use_cache=False).logits
        logp, _ = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], temp)
        if surrogate:
            # REINFORCE with τ weights: -Σ_i w̃_i A_i Σ_t ∇logp_it / N
            obj = -(mb.weights[:, None] * mb.advantages[:, None] * mb.loss_mask * logp).sum() / n
        else:
            obj, sums, maxima = policy_loss(logp, logp.detach(), mb.loss_mask, mb.advantages, mb.weights,
                                            clip_low=CLIP_LOW, clip_high=CLIP_HIGH, batch_loss_tokens=n)
            m = loss_metrics(sums, maxima)
            assert m["ratio/mean"] == pytest.approx(1.0) and m["clip_fraction"] == 0.0
        obj.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    g_loss, g_pg = grads(False), grads(True)
    for k in g_loss:
        assert torch.allclose(g_loss[k], g_pg[k], atol=1e-7, rtol=1e-5), k
    assert any(float(g.abs().max()) > 1e-4 for g in g_pg.values())


def test_kl_to_reference_k3_and_entropy_metric():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.tensor([[True, True]])
    loss, sums, maxima = policy_loss(logp, logp.detach(), mask, torch.tensor([0.0]), torch.tensor([1.0]),
                                     clip_low=CLIP_LOW, clip_high=CLIP_HIGH, batch_loss_tokens=2, ref_logp=ref,
                                     kl_coef=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert float(loss.detach()) == pytest.approx(0.1 * k3 / 2, rel=1e-6)       # A = 0: only the KL term remains
    m = loss_metrics(sums, maxima)
    assert m["kl"] == pytest.approx(k3 / 2, rel=1e-6)
    assert m["pg_loss"] == 0.0 and m["loss"] == pytest.approx(0.1 * k3 / 2, rel=1e-6)
    with pytest.raises(ValueError, match="kl_coef"):
        policy_loss(logp, logp.detach(), mask, torch.tensor([0.0]), torch.tensor([1.0]), clip_low=0.2,
                    clip_high=0.2, batch_loss_tokens=2, kl_coef=0.1)

    # Uniform logits: entropy log V whatever the temperature; log-prob -log V.
    logits = torch.zeros(1, 3, 10)
    lp, ent = token_logprobs(logits, torch.tensor([[1, 2, 3]]), temperature=0.7)
    assert torch.allclose(ent, torch.full((1, 3), math.log(10)))
    assert torch.allclose(lp, torch.full((1, 3), -math.log(10)))
    # Temperature scales the logits before the softmax, as the rollout engine does.
    logits = torch.tensor([[[2.0, 0.0]]])
    lp, _ = token_logprobs(logits, torch.tensor([[0]]), temperature=0.5)
    assert float(lp) == pytest.approx(4.0 - math.log(math.exp(4.0) + 1.0), rel=1e-5)
