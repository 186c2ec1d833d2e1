"""The character tokenizer and the tiny Qwen3 policy: round trips, offline loading, atomic saves."""

from __future__ import annotations

import json
import os
import string

import pytest
import torch

from reflow_hpc import config as C
from reflow_hpc import envs
from reflow_hpc.envs.calculator_tool import CALL_CLOSE, MARKERS
from reflow_hpc.envs.tokenizer import build_char_tokenizer
from reflow_hpc.policy import build_tiny_policy, load_policy, num_parameters, save_policy

pytestmark = pytest.mark.usefixtures("offline")


def small_cfg(**over) -> C.Config:
    sets = ["model.warmstart=true", "model.tiny_hidden_size=64", "model.tiny_layers=2", "model.tiny_heads=4",
            "model.tiny_kv_heads=2", "model.tiny_head_dim=16", "model.tiny_intermediate_size=128"]
    return C.load(None, sets + [f"{k}={v}" for k, v in over.items()])


TEXTS = [
    "47+8+35=",
    "47+8=55\n55+35=90\n#### 90",
    string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", ""),
    "  leading and trailing spaces  ",
    f"x=<tool_call>12*(3+4){CALL_CLOSE}<tool_response>84</tool_response>\n#### 84",
    r"\boxed{\frac{1}{2}} and $x^2$ {braces} [brackets] ~`|",
    "",
]


def test_tokenizer_round_trip_is_exact():
    tok = build_char_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
        raw = tok.encode(text, add_special_tokens=False)
        assert tok.decode(raw) == text
        assert tok.unk_token_id not in ids


def test_tokenizer_one_token_per_character_and_markers():
    tok = build_char_tokenizer()
    assert len(tok.encode("12+34", add_special_tokens=False)) == 5
    for m in MARKERS:
        assert len(tok.encode(m, add_special_tokens=False)) == 1
    assert len(tok) == 4 + len(MARKERS) + 95 + 1
    assert tok.decode(tok.encode("é", add_special_tokens=False)) == "<unk>"


def test_byte_tokenizer_encodes_any_utf8_text_one_token_per_byte(tmp_path):
    from transformers import AutoTokenizer

    from reflow_hpc.envs.tokenizer import build_byte_tokenizer, build_tokenizer

    tok = build_byte_tokenizer()
    texts = [*TEXTS, "def f(xs):\n\treturn sum(xs)  # ∑ — é 世界\x00\x7f", "\u00a0\U0001f600 ÿ"]
    for text in texts:
        raw = tok.encode(text, add_special_tokens=False)
        plain = text
        for m in MARKERS:                        # a tool marker is one token, as in the char tokenizer
            plain = plain.replace(m, "\x01")
        assert len(raw) == len(plain.encode()) and tok.unk_token_id not in raw
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert [tok.encode(chr(b), add_special_tokens=False)[0] for b in range(0x20, 0x7f)] == \
        [4 + len(MARKERS) + b for b in range(0x20, 0x7f)]          # byte order: ids are stable
    for m in MARKERS:
        assert len(tok.encode(m, add_special_tokens=False)) == 1
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again.decode(again.encode(texts[-2]), skip_special_tokens=True) == texts[-2]
    assert len(build_tokenizer("byte")) == 4 + len(MARKERS) + 256
    with pytest.raises(ValueError, match="char or byte"):
        build_tokenizer("words")


def test_every_builtin_task_text_tokenizes_without_unk(tmp_path):
    tok = build_char_tokenizer()
    for name in ("arithmetic", "calculator_tool"):
        task = envs.make_task(C.load(None, ["model.warmstart=true", f"task.name={name}", "task.ops=+-"]))
        for i in range(50):
            p = task.prompt(i)
            for text in (p.text, task.solution(p)):
                ids = tok.encode(text)
                assert tok.unk_token_id not in ids
                assert tok.decode(ids, skip_special_tokens=True) == text


def test_stop_token_ids_of_the_calculator():
    tok = build_char_tokenizer()
    task = envs.make_task(C.load(None, ["model.warmstart=true", "task.name=calculator_tool"]))
    ids = task.stop_token_ids(tok)
    assert ids == (tok.eos_token_id, tok.convert_tokens_to_ids(CALL_CLOSE))
    assert envs.make_task(C.load(None, ["model.warmstart=true"])).stop_token_ids(tok) == (tok.eos_token_id,)


def test_prompt_token_ids_raw_and_chat_template():
    tok = build_char_tokenizer()
    assert envs.prompt_token_ids(tok, "1+2=") == tok.encode("1+2=")
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    ids = envs.prompt_token_ids(tok, "1+2=", chat_template=True)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == "[user]1+2=[assistant]"


def test_tokenizer_saves_and_loads_offline_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
        assert again.decode(again.encode(text), skip_special_tokens=True) == text
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)


def test_default_tiny_policy_size():
    model, tok = build_tiny_policy(C.load(None, ["model.warmstart=true"]))
    assert 1_000_000 <= num_parameters(model) <= 10_000_000
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tok)


def test_build_is_deterministic_in_the_seed():
    a, _ = build_tiny_policy(small_cfg())
    b, _ = build_tiny_policy(small_cfg())
    c, _ = build_tiny_policy(small_cfg(**{"run.seed": 3}))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_bad_head_split_is_a_config_error():
    with pytest.raises(C.ConfigError) as e:
        build_tiny_policy(small_cfg(**{"model.tiny_kv_heads": 3}))
    assert str(e.value).startswith("config error: model.tiny_kv_heads")


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = build_tiny_policy(small_cfg())
    model.eval()
    out = save_policy(model, tok, tmp_path / "policy")
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]          # no temporary left behind

    ids = torch.tensor([tok.encode("47+8+35=47+8=55\n")])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    loaded, tok2 = load_policy(out)
    assert not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref)
    assert tok2.encode("47+8+35=") == tok.encode("47+8+35=")

    plain = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, ref)
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).decode(ids[0], skip_special_tokens=True) \
        == "47+8+35=47+8=55\n"

    half, _ = load_policy(out, dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_save_replaces_an_existing_policy_and_cleans_up_on_failure(tmp_path):
    model, tok = build_tiny_policy(small_cfg())
    dest = tmp_path / "policy"
    save_policy(model, tok, dest)
    other, _ = build_tiny_policy(small_cfg(**{"run.seed": 5}))
    save_policy(other, tok, dest)
    loaded, _ = load_policy(dest)
    ref = other.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]

    class Broken:
        def save_pretrained(self, path, **kw):
            os.makedirs(path, exist_ok=True)
            (path / "config.json").write_text("{}")
            raise OSError("disk full")

    with pytest.raises(OSError):
        save_policy(model, Broken(), tmp_path / "fresh")
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]          # nothing half-written looks valid


def test_load_policy_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_policy(tmp_path / "nowhere")
