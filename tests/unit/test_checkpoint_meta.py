"""A checkpoint's meta.json names the files load_checkpoint reads (``extra/<key>.json``): every key must be
a plain file name whose file lies inside the checkpoint's ``extra`` directory, or loading fails with one
line naming meta.json and the key before anything is read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from reflow_hpc.train.checkpoint import load_checkpoint


def _step_dir(root, meta: dict, extra: dict | None = None):
    """A step directory as save_checkpoint lays it out, without a model (load_checkpoint reads none here)."""
    step = root / "checkpoints" / "step_000001"
    (step / "extra").mkdir(parents=True)
    torch.save({"step": 1, "trainer": {}, "rng": {}}, step / "trainer.pt")
    for key, value in (extra or {}).items():
        (step / "extra" / f"{key}.json").write_text(json.dumps(value))
    (step / "meta.json").write_text(json.dumps(meta))
    return step


def test_extra_keys_that_are_file_names_load(tmp_path):
    step = _step_dir(tmp_path, {"step": 1, "extra": ["coordinator", "manifest.rank-0"], "format": 1},
                     {"coordinator": {"a": 1}, "manifest.rank-0": [1, 2]})
    ck = load_checkpoint(step, restore_rng=False)
    assert ck.step == 1 and ck.extra == {"coordinator": {"a": 1}, "manifest.rank-0": [1, 2]}


@pytest.mark.parametrize("key", ["../../outside", "../outside", "sub/../../../outside", "..", ".",
                                 "/tmp/outside", "a\\..\\b", "coordinator\n", 7, None])
def test_a_key_that_is_not_a_plain_file_name_is_refused_naming_meta_json_and_the_key(tmp_path, key):
    # The file a "../../outside" key reaches: <checkpoint root>/outside.json, outside the step directory.
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "outside.json").write_text('{"secret": true}')
    step = _step_dir(tmp_path, {"step": 1, "extra": [key], "format": 1})
    with pytest.raises(ValueError) as err:
        load_checkpoint(step, restore_rng=False)
    text = str(err.value)
    assert "\n" not in text and str(step / "meta.json") in text and repr(key) in text


def test_a_symlink_out_of_the_extra_directory_is_refused(tmp_path):
    step = _step_dir(tmp_path, {"step": 1, "extra": ["coordinator"], "format": 1})
    (tmp_path / "elsewhere.json").write_text('{"secret": true}')
    os.symlink(tmp_path / "elsewhere.json", step / "extra" / "coordinator.json")
    with pytest.raises(ValueError, match="extra key 'coordinator' is not a plain file name"):
        load_checkpoint(step, restore_rng=False)


@pytest.mark.parametrize("meta, what", [([1], "not an object"), ({"step": "1"}, "step '1'"),
                                        ({"step": True}, "step True"), ({"step": 1, "extra": "coordinator"},
                                                                        "extra is a str")])
def test_a_meta_json_of_the_wrong_shape_is_refused(tmp_path, meta, what):
    step = _step_dir(tmp_path, {"step": 1})
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=what):
        load_checkpoint(step, restore_rng=False)
