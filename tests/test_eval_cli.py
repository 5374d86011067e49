"""erft eval and erft filter on a micro policy and a local JSONL dataset; the metric helpers by hand."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from entropy_rft.analysis.evaluate import markdown_table  # noqa: E402
from entropy_rft.analysis.pass_filter import keep_question  # noqa: E402
from entropy_rft.cli.eval import pass_ks  # noqa: E402
from entropy_rft.cli.main import main  # noqa: E402
from entropy_rft.policy.evaluation import pass_at_k_from_hist  # noqa: E402
from micro import make_micro_policy  # noqa: E402


def test_pass_at_k_from_hist_matches_naive_enumeration():
    from itertools import combinations

    def naive(n, c, k):  # probability that a random k-subset holds a correct sample
        items = [1] * c + [0] * (n - c)
        subs = list(combinations(range(n), k))
        return sum(any(items[i] for i in s) for s in subs) / len(subs)

    hist = [2, 1, 0, 3, 1]  # n = 4
    got = pass_at_k_from_hist(hist, [1, 2, 4])
    for k in (1, 2, 4):
        want = sum(h * naive(4, c, k) for c, h in enumerate(hist)) / sum(hist)
        assert math.isclose(got[k], want, rel_tol=1e-12)
    assert pass_ks(None, 32) == [1, 8, 32] and pass_ks("2,1", 4) == [1, 2]


def test_keep_question_paper_thresholds():
    kept = [c for c in range(17) if keep_question(c, 16, 1 / 16, 15 / 16)]
    assert kept == list(range(2, 15))


def test_markdown_table():
    res = [{"model": "m", "dataset": "d", "questions": 3, "metrics": {"avg@4": 0.5, "pass@1": 0.5, "maj@4": 0.25}}]
    md = markdown_table(res, [1], 4)
    assert "| model | d avg@4 | d pass@1 | d maj@4 |" in md and "| m | 50.00 | 50.00 | 25.00 |" in md


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalcli")
    model = make_micro_policy(tmp / "micro")
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}{b}", "answer": str(a)}) + "\n"
                            for a in range(1, 10) for b in range(1, 4)))
    # a custom reward by import path: right when the response starts with the answer's digit
    (tmp / "erft_eval_reward.py").write_text(
        "def rew(response, answer):\n    return float(response[:1] == str(answer))\n")
    sys.path.insert(0, str(tmp))
    return tmp, model, data


def test_prompts_that_do_not_fit_the_context_are_refused(setup, capsys):
    # The micro policy has 64 positions: 64 new tokens leave no room, and 80-digit prompts alone fill it.
    tmp, model, data = setup
    long_data = tmp / "long.jsonl"
    long_data.write_text("".join(json.dumps({"prompt": f"{i}" + "1" * 80, "answer": "1"}) + "\n" for i in range(8)))
    for source, budget, must in ((data, "64", "--max-new-tokens (64) leaves no room"),
                                 (long_data, "2", "do not fit the model's context")):
        out = tmp / f"nofit-{budget}"
        args = ["eval", "--model", str(model), "--dataset", "math", "--task-param", f"source={source}",
                "--task-param", "val_size=4", "--task-param", "prompt_format=plain", "--task-param",
                "reward=erft_eval_reward:rew", "--samples", "2", "--max-new-tokens", budget, "--out", str(out)]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert must in err[-1] and "--dataset" in err[-1], err
        assert not out.exists()


def test_erft_eval_writes_json_md_png(setup):
    tmp, model, data = setup
    out = tmp / "eval"
    args = ["eval", "--model", str(model), "--dataset", "math", "--task-param", f"source={data}",
            "--task-param", "val_size=6", "--task-param", "prompt_format=plain", "--task-param",
            "reward=erft_eval_reward:rew", "--samples", "8", "--temperature", "1.0", "--max-new-tokens", "2",
            "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    rep = json.loads((out / "eval.json").read_text())
    (r,) = rep["results"]
    hist, m = r["pass_rate_hist"], r["metrics"]
    assert sum(hist) == 6 and len(hist) == 9
    # Avg@8 is the mean pass rate; Pass@1 equals it; Pass@8 is the share with at least one right
    assert math.isclose(m["avg@8"], sum(c * h for c, h in enumerate(hist)) / 48)
    assert math.isclose(m["pass@1"], m["avg@8"])
    assert math.isclose(m["pass@8"], 1 - hist[0] / 6)
    assert 0 < m["avg@8"] < 1  # the micro policy is right sometimes
    assert (out / "eval.md").read_text().startswith("| model |")
    assert (out / "pass_rate_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(args[:-2] + ["--out", str(tmp / "eval2")]) == 0  # same seed, same figures
    assert json.loads((tmp / "eval2" / "eval.json").read_text())["results"][0]["metrics"] == m


def test_erft_filter(setup):
    tmp, model, data = setup
    out = tmp / "filt"
    assert main(["filter", "--model", str(model), "--dataset", "math", "--task-param", f"source={data}",
                 "--task-param", "val_size=6", "--task-param", "reward=erft_eval_reward:rew",
                 "--task-param", "prompt_format=plain", "--n", "16", "--max-new-tokens", "1",
                 "--temperature", "1.0", "--threads", "1", "--out", str(out)]) == 0
    kept = [json.loads(x) for x in (out / "filtered.jsonl").read_text().splitlines()]
    dropped = [json.loads(x) for x in (out / "dropped.jsonl").read_text().splitlines()]
    summary = json.loads((out / "filter.json").read_text())
    assert len(kept) + len(dropped) == summary["questions"] == 21  # 27 rows minus the 6 held out
    assert all(1 < r["correct"] < 15 and r["pass_rate"] == r["correct"] / 16 for r in kept)
    assert all(r["correct"] <= 1 or r["correct"] >= 15 for r in dropped)
    assert sum(summary["pass_rate_hist"]) == 21
    assert (out / "pass_rate_hist.png").is_file()
    # the filtered file trains as a task again (raw questions, answers)
    from entropy_rft.tasks import build_task

    if kept:
        t = build_task("math", source=str(out / "filtered.jsonl"), val_size=0)
        assert sorted(q for q, _, _ in t.pairs) == sorted(r["prompt"] for r in kept)


def test_eval_user_errors(setup, capsys):
    tmp, model, _ = setup
    assert main(["eval", "--out", str(tmp / "x")]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert main(["eval", "--model", str(model), "--samples", "4", "--pass-k", "8", "--out", str(tmp / "x")]) == 2
    assert "--pass-k" in capsys.readouterr().err
    assert main(["eval", "--run", str(tmp), "--out", str(tmp / "x")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_sampling_flags_are_declared_once():
    """eval and filter take the shared sampling flags from cli.flags: the same type, default and help where the
    commands do not say otherwise; a flag given its own words that is not added is a programming error."""
    import argparse

    from entropy_rft.cli import eval as eval_cmd
    from entropy_rft.cli import filter as filter_cmd
    from entropy_rft.cli.flags import SAMPLING_FLAGS, add_sampling_flags

    def actions(mod):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        return {a.option_strings[0]: a for a in p._actions if a.option_strings}

    ev, fl = actions(eval_cmd), actions(filter_cmd)
    for flag in ("--max-new-tokens", "--batch-size", "--device", "--dtype", "--threads"):
        assert (ev[flag].type, ev[flag].default, ev[flag].help, ev[flag].choices) == \
               (fl[flag].type, fl[flag].default, fl[flag].help, fl[flag].choices) == \
               (SAMPLING_FLAGS[flag].get("type"), SAMPLING_FLAGS[flag]["default"], SAMPLING_FLAGS[flag]["help"],
                SAMPLING_FLAGS[flag].get("choices"))
    assert (ev["--temperature"].default, fl["--temperature"].default) == (0.7, 1.0)  # each command's own
    assert ev["--seed"].help != fl["--seed"].help and ev["--seed"].default == fl["--seed"].default == 0
    with pytest.raises(TypeError, match="samples"):
        add_sampling_flags(argparse.ArgumentParser(), "--seed", samples={"default": 3})
