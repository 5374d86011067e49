"""Math tasks: local files with a column mapping, bad rows, DAPO500, champ, gsm_symbolic, chat prompts."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entropy_rft.common.errors import UserError
from entropy_rft.policy.rollout import tokenize_prompts
from entropy_rft.tasks import build_task
from entropy_rft.tasks.math import DAPO_PREFIX, DAPO_SUFFIX, MathTask, champ_answer, get_path
from entropy_rft.tasks.prompts import ChatPrompt, encode_prompt, make_prompt


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_bad_rows_counted_and_skipped(tmp_path, capsys):
    rows = [{"q": "one?", "a": "1"}, {"q": "two?"}, {"q": "", "a": "3"}, "{not json",
            {"q": ["x"], "a": "4"}, {"q": "five?", "a": True}, {"q": "six?", "a": 6}, {"q": "seven?", "a": 7.0}]
    src = _jsonl(tmp_path / "d.jsonl", rows)
    t = build_task("math", source=src, prompt_key="q", answer_key="a", val_size=1)
    assert [(q, a, i) for q, a, i in t.pairs] == [("one?", "1", 0), ("six?", "6", 6), ("seven?", "7", 7)]
    assert t.bad_rows.n_bad == 5 and t.bad_rows.first == 1
    err = capsys.readouterr().err
    assert "5 of 8 rows are bad" in err and "first bad row is index 1" in err
    with pytest.raises(UserError, match=r"d.jsonl.*5 of 8 rows are bad.*index 1.*on_bad_rows=skip"):
        build_task("math", source=src, prompt_key="q", answer_key="a", on_bad_rows="error")
    with pytest.raises(UserError, match="no usable rows"):
        build_task("math", source=src, prompt_key="question", answer_key="a")
    with pytest.raises(UserError, match="not found"):
        build_task("math", source=str(tmp_path / "missing.parquet"))


def test_parquet_nested_mapping_dapo_cleaning_and_dapo500(tmp_path):
    n = 30
    table = pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": DAPO_PREFIX + f"Q{i % 25}?" + DAPO_SUFFIX}],
         "reward_model": {"ground_truth": str(i % 25), "style": "rule"}} for i in range(n)])
    path = tmp_path / "dapo.parquet"
    pq.write_table(table, path)
    t = build_task("dapo_math_17k", source=str(path), val_size=5)
    assert len(t.pairs) == 25  # duplicates dropped
    assert t.pairs[3][:2] == ("Q3?", "3")
    tr0, va0 = t.split(0)
    tr1, va1 = t.split(1)
    assert [e.answer for e in va0] == [e.answer for e in va1]  # DAPO500 does not move with the run seed
    assert len(va0) == 5 and len(tr0) == 20
    assert not {e.meta["question"] for e in tr0} & {e.meta["question"] for e in va0}
    assert [e.answer for e in tr0] != [e.answer for e in tr1]  # train order does
    held = build_task("dapo500", source=str(path), val_size=5).split(3)[1]
    assert [e.meta["question"] for e in held] == [e.meta["question"] for e in va0]
    assert isinstance(va0[0].prompt, ChatPrompt) and "Q" in va0[0].prompt and "\\boxed{}" in va0[0].prompt


def test_json_and_get_path(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"data": [{"problem": "a?", "answer": "1"}, {"problem": "b?", "answer": "2"}]}))
    t = build_task("aime24", source=str(p))  # an eval benchmark: everything is validation
    assert t.split(0) == ([], t.split(0)[1]) and len(t.split(0)[1]) == 2
    assert get_path({"a": [{"b": 3}]}, "a[0].b") == 3
    assert get_path({"a": [{"b": 3}]}, "a[-1].b") == 3
    assert get_path({"a": []}, "a[0].b") is not None  # the MISSING marker, not a crash


def test_reward_format_penalty_and_custom_reward(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": "1/2"} for i in range(4)])
    t = build_task("math", source=src, val_size=1, format_penalty=0.5)
    ex = t.split(0)[1][0]
    assert t.reward(r"\boxed{0.5}", ex) == 1.0
    assert t.reward(r"\boxed{0.6}", ex) == 0.0
    assert t.reward("0.5", ex) == -0.5
    assert t.canonical(r"\boxed{\frac{2}{4}}", ex) == t.canonical(r"\boxed{0.5}", ex) == "1/2"
    (tmp_path / "my_reward.py").write_text("def rew(response, answer):\n    return float(len(response) == 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    c = build_task("math", source=src, val_size=1, reward="my_reward:rew")
    assert c.reward("abc", ex) == 1.0 and c.reward("ab", ex) == 0.0
    with pytest.raises(UserError, match="cannot be imported"):
        build_task("math", source=src, reward="my_reward:nope")


def test_champ_and_gsm_symbolic_gold_answers_verify():
    assert champ_answer("C(10, 5), or equivalently 252") == "252"
    assert champ_answer("3 is the only possible value") == "3"
    assert champ_answer("The limit exists and is equal to 2/3") == "2/3"
    assert champ_answer("No") is None
    c = build_task("champ")
    tr, va = c.split(0)
    assert len(tr) + len(va) == len(c.pairs) and len(va) == 50 and len(c.pairs) >= 150
    exs = tr[:10] + va[:10]
    scores = c.check_many([rf"\boxed{{{e.answer}}}" for e in exs], exs)
    assert [s for s, _ in scores] == [1.0] * 20
    g = build_task("gsm_symbolic", size=60)
    gtr, gva = g.split(0)
    assert len(gva) == 50 and len(gtr) == len(g.pairs) - 50
    assert all(g.reward(rf"\boxed{{{e.answer}}}", e) == 1.0 for e in gva[:5])
    assert g.reward(rf"\boxed{{{gva[0].answer}1}}", gva[0]) == 0.0


def test_chat_prompt_rendered_at_tokenisation():
    from entropy_rft.models.loading import build_char_tokenizer

    tok = build_char_tokenizer()
    plain = make_prompt("1+1?", prompt_format="plain")
    chat = make_prompt("1+1?", prompt_format="chat")
    assert str(chat) == plain and not isinstance(plain, ChatPrompt)
    assert encode_prompt(tok, chat) == encode_prompt(tok, plain)  # no chat template: plain text
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    want = tok("<user>" + plain + "<assistant>", add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, chat) == want
    ids, mask = tokenize_prompts(tok, [chat, plain])
    assert ids[0][mask[0]].tolist() == want
    assert ids[1][mask[1]].tolist() == tok(plain, add_special_tokens=True)["input_ids"]
    import pickle

    again = pickle.loads(pickle.dumps(ChatPrompt("x", system="s")))
    assert isinstance(again, ChatPrompt) and again.messages[0] == {"role": "system", "content": "s"}


def test_bad_params_are_user_errors(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "1"}] * 1)
    for kw, field in [({"prompt_format": "html"}, "prompt_format"), ({"on_bad_rows": "ignore"}, "on_bad_rows"),
                      ({"val_size": 5}, "val_size"), ({"template": "no slot"}, "template")]:
        with pytest.raises(UserError, match=field):
            MathTask(source=src, **kw)
    with pytest.raises(UserError, match="dataset"):
        MathTask("nope")
    assert "entropy_rft.tasks.math" in sys.modules


def test_batched_rewards_equal_hand_scores(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": a} for i, a in enumerate(["1/2", "x^2+2x+1"])])
    t = build_task("math", source=src, val_size=0, format_penalty=0.5)
    a, b = t.split(0)[0]
    half, square = (a, b) if a.answer == "1/2" else (b, a)
    responses = [r"so \boxed{0.5}", r"\boxed{(x+1)^2}", r"\boxed{3}", "no box", r"\boxed{\frac{1}{2}}"]
    exs = [half, square, half, square, half]
    assert t.rewards(responses, exs) == [1.0, 1.0, 0.0, -0.5, 1.0]
