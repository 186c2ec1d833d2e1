r"""The math scorer (reflow_hpc.envs.math_reward): answer formats, equivalence through math-verify in its
own process, inputs it must not mis-score, bounded calls from any thread, and DAPO-Math-17k end to end."""

from __future__ import annotations

import os
import threading

import pytest

from reflow_hpc.envs import math_reward
from reflow_hpc.envs.math_score import equivalence_process, extract_answer, normalize_final_answer

pytest.importorskip("math_verify", reason="the math extra (pip install -e '.[math]') is not installed")


@pytest.mark.parametrize("response,reference,reward", [
    ("Let me think.\nAnswer: 34", "34", 1.0),           # DAPO-Math-17k's format
    ("answer:34", "34", 1.0),
    ("**Answer:** $34$.", "34", 1.0),
    ("Answer: 33\nwait, no.\nAnswer: 34", "34", 1.0),   # the last answer line counts
    ("Answer: 34\nAnswer: 33", "34", 0.0),
    (r"\boxed{34}", "34", 1.0),
    (r"Answer: 33 ... so \boxed{34}", "34", 1.0),       # the later of the two counts
    (r"\boxed{33} ... Answer: 34", "34", 1.0),
    (r"\boxed{34} ... Answer: 33", "34", 0.0),
    (r"Answer: \boxed{34}", "34", 1.0),
    ("Answer: 35", "34", 0.0),
    ("the result is 34", "34", 0.0),                    # no stated answer
    (r"Answer: 33 then \boxed{34", "34", 0.0),          # cut off inside the later box
    ("Answer: x = 34", "34", 1.0),
    (r"Answer: 1,000", "1000", 1.0),
    (r"Answer: 90^\circ", "90", 1.0),
    (r"Answer: \text{5 units}", "5", 1.0),
])
def test_answer_formats(response, reference, reward):
    assert math_reward(response, reference) == reward


@pytest.mark.parametrize("answer,reference", [
    (r"\frac{\sqrt2}{2}", r"\frac{1}{\sqrt2}"),
    ("2^{10}", "1024"),
    (r"3\sqrt2", r"\sqrt{18}"),
    (r"\{2,1\}", r"\{1,2\}"),
    (r"\dfrac{1}{2}", "0.5"),
])
def test_equivalent_answers_written_differently(answer, reference):
    assert math_reward(f"Answer: {answer}", reference) == 1.0
    assert math_reward(rf"\boxed{{{answer}}}", reference) == 1.0


@pytest.mark.parametrize("response,reference,reward", [
    ("Answer: 5%0", "50", 0.0),                 # % is never dropped from inside an answer
    ("Answer: \u22125", "-5", 1.0),             # Unicode minus
    (r"\boxed{\text{\text{5}}}", "5", 1.0),     # nested \text
    (r"\boxed{}", "", 0.0),                      # an empty answer never scores
    ("Answer: ", "", 0.0),
    (r"\boxed{\text{}}", r"\text{}", 0.0),
    (r"\boxed{(1,2)}", "(2,1)", 0.0),
    ("Answer: 7", "-7", 0.0),
])
def test_inputs_once_mis_scored(response, reference, reward):
    assert math_reward(response, reference) == reward


def test_dapo_normalisation_rules():
    assert normalize_final_answer(r"$\frac12$") == r"\frac{1}{2}"
    assert normalize_final_answer(r"\sqrt3") == r"\sqrt{3}"
    assert normalize_final_answer("12 degrees") == "12"
    assert normalize_final_answer("1,234,567") == "1234567"
    assert normalize_final_answer(r"\textbf{7}") == "7"
    assert extract_answer(r"Answer: 1 \boxed{2}") == "2"
    assert extract_answer("nothing") is None


def _in_thread(fn):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join(10)   # generous: the bound is 2 s plus a fresh process's start
    assert not t.is_alive(), "the call did not return"
    return out["v"]


@pytest.mark.parametrize("answer,reference", [
    ("9" * 6000, "1"),
    ("2^{2^{2^{2^{2^{2}}}}}", "4"),
    ("{" * 3000 + "5" + "}" * 3000, "6"),
], ids=["6000 digits", "tower of powers", "3000 nested braces"])
def test_hostile_answers_return_within_the_bound_off_the_main_thread(answer, reference):
    assert _in_thread(lambda: math_reward(rf"\boxed{{{answer}}}", reference)) == 0.0
    assert _in_thread(lambda: math_reward(r"\boxed{2^{10}}", "1024")) == 1.0   # the scorer still works after


def test_equal_huge_answers_take_the_fast_path():
    assert math_reward("Answer: " + "9" * 6000, "9" * 6000) == 1.0


def test_the_equivalence_process_is_a_fresh_interpreter():
    info = equivalence_process().start()
    assert info["pid"] != os.getpid() and info["ppid"] == os.getpid()
    # a forked child would hold every module its parent had imported, reflow_hpc included
    assert info["reflow_hpc_loaded"] is False
    assert info["limit_as"] == 512 << 20
    with open(f"/proc/{info['pid']}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert argv[1] == b"-P" and argv[2].endswith(b"math_equiv_worker.py")


def test_a_process_that_died_between_calls_is_replaced():
    import signal
    info = equivalence_process().start()
    os.kill(info["pid"], signal.SIGKILL)
    assert math_reward(r"\boxed{2^{11}}", "2048") == 1.0
    assert equivalence_process().start()["pid"] != info["pid"]


def test_concurrent_calls_from_many_threads():
    cases = [(r"\boxed{2^{10}}", "1024", 1.0), ("Answer: 34", "34", 1.0), ("Answer: 3", "4", 0.0),
             (r"\boxed{\frac{1}{\sqrt2}}", r"\frac{\sqrt2}{2}", 1.0)] * 4
    got: list = [None] * len(cases)

    def score(i):
        got[i] = math_reward(cases[i][0], cases[i][1])

    threads = [threading.Thread(target=score, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == [c[2] for c in cases]


# --------------------------------------------------------------------------------------------
# DAPO-Math-17k end to end: a parquet file in the dataset's schema, read by the 128-GPU config's keys
# --------------------------------------------------------------------------------------------

SYSTEM = "You are a careful mathematician."
PROBLEM = ("Solve the following math problem step by step. The last line of your response should be of the form "
           "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 17 + 17?\n\n"
           "Remember to put your answer on its own line after \"Answer:\"")


def _dapo_parquet(path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"data_source": "math_dapo",
             "prompt": [{"content": SYSTEM, "role": "system"}, {"content": PROBLEM, "role": "user"}],
             "ability": "MATH",
             "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"}}]
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(message)), ("ability", pa.string()),
                        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
                        ("extra_info", pa.struct([("index", pa.string())]))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_dapo_math_parquet_end_to_end(tmp_path):
    from pathlib import Path

    from reflow_hpc import config as C
    from reflow_hpc import envs
    from reflow_hpc.envs.tokenizer import build_char_tokenizer

    path = tmp_path / "dapo-math-17k.parquet"
    _dapo_parquet(path)
    big = Path(__file__).resolve().parents[2] / "configs" / "qwen3_8b_dapo_128gpu.toml"
    cfg = C.load(str(big), [f"data.path={path}", "task.eval_fraction=0"], check_files=False)
    assert (cfg.task.name, cfg.task.chat_template) == ("math_boxed", True)
    task = envs.make_task(cfg)
    p = task.prompt(0)
    assert p.answer == "34" and p.text == PROBLEM
    assert task.reward(p, "17 + 17 = 34.\nAnswer: 34") == 1.0
    assert task.reward(p, r"So the sum is \boxed{34}.") == 1.0
    assert task.reward(p, "Answer: 35") == 0.0
    assert task.reward(p, "34") == 0.0                        # no stated answer

    tok = build_char_tokenizer(max_length=4096)
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids = envs.prompt_token_ids(tok, p, chat_template=cfg.task.chat_template)
    assert tok.decode(ids, skip_special_tokens=True) == f"<system>{SYSTEM}<user>{PROBLEM}<assistant>"
    raw = tok.decode(envs.prompt_token_ids(tok, p), skip_special_tokens=True)
    assert raw == f"{SYSTEM}\n\n{PROBLEM}"                    # raw text keeps the system message too
