"""The schedule point a new trainer replica receives travels as JSON, not as a pickle: the encoding takes
exactly what the trainer sends (numbers, strings, lists, dicts), gives back an equal dict, and refuses
anything that would not come back the same."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from hypothesis import given, strategies as st

from reflow_hpc.config import load
from reflow_hpc.train.optim import build_scheduler
from reflow_hpc.train.replicas import decode_meta, encode_meta

from conftest import ROOT

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.text()
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=20)


def _schedule_point(steps: int) -> tuple[dict, torch.optim.Optimizer]:
    """The ``meta`` Trainer.send_state sends, after ``steps`` updates of the main config's schedule."""
    cfg = load(str(ROOT / "configs" / "cpu_tiny.toml")).trainer
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    for _ in range(steps):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    return {"step": steps, "scheduler": sched.state_dict(), "lrs": [g["lr"] for g in opt.param_groups]}, opt


def test_the_trainers_schedule_point_round_trips_and_restores_the_schedule():
    meta, opt = _schedule_point(7)
    back = decode_meta(encode_meta(meta))
    assert back == meta
    cfg = load(str(ROOT / "configs" / "cpu_tiny.toml")).trainer
    p = torch.nn.Parameter(torch.zeros(3))
    fresh = torch.optim.AdamW([p], lr=cfg.lr)
    sched = build_scheduler(fresh, cfg)
    sched.load_state_dict(back["scheduler"])
    for g, lr in zip(fresh.param_groups, back["lrs"]):
        g["lr"] = lr
    p.grad = torch.ones(3)
    fresh.step()
    sched.step()
    ref, ref_opt = _schedule_point(8)
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in ref_opt.param_groups] == ref["lrs"]
    assert sched.state_dict() == ref["scheduler"]


@given(st.dictionaries(st.text(), JSON, max_size=6))
def test_every_json_value_round_trips_exactly(meta):
    back = decode_meta(encode_meta(meta))
    assert back == meta
    assert json.dumps(back, sort_keys=True) == json.dumps(meta, sort_keys=True)   # -0.0 and int/float kept


@pytest.mark.parametrize("meta, where", [
    ({"lrs": (1e-4,)}, "meta['lrs']: a tuple"),
    ({"scheduler": {1: 2}}, "meta['scheduler']: key 1 (int) is not a string"),
    ({"lrs": [math.nan]}, "meta['lrs'][0] = nan"),
    ({"lrs": [math.inf]}, "meta['lrs'][0] = inf"),
    ({"step": torch.tensor(3)}, "meta['step']: a Tensor"),
    ({"blob": b"x"}, "meta['blob']: a bytes"),
])
def test_what_would_not_come_back_the_same_is_refused_naming_it(meta, where):
    with pytest.raises(ValueError, match=f"^{re.escape(where)}"):
        encode_meta(meta)


def test_decoding_takes_only_a_json_object_of_finite_numbers():
    for raw in (b"[1, 2]", b'{"lr": NaN}', b'{"lr": Infinity}', b"\x80\x04K\x01.", b"{"):
        with pytest.raises(ValueError):
            decode_meta(raw)
