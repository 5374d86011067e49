"""A local JSONL dataset is read in bounded memory (issue 65, item 10): the questions a split picks are the ones
the documented rule picks from the file's usable rows, only the rows a split needs are parsed again, and loading
holds offsets, never the rows (before: the whole file, about 6x its size, to evaluate 4 questions)."""

import json
import random
import tracemalloc

import pytest

from entropy_rft.common.errors import UserError
from entropy_rft.tasks import build_task
from entropy_rft.tasks import rows as rows_mod

PAD = "x" * 3000  # ~3 KB a row: 3000 rows make a 7.7 MB file


def write_dataset(path, n):
    """``n`` rows, some of them bad (not JSON, no answer), duplicated or blank, so that a usable row's index in the
    file, its row index and its place among the usable rows all differ."""
    lines = []
    for k in range(n):
        if k % 17 == 5:
            lines.append("   ")  # blank: not a row
        if k % 11 == 3:
            lines.append('{"prompt": "broken')  # a bad row
        elif k % 13 == 4:
            lines.append(json.dumps({"prompt": f"no answer {k}"}))  # a bad row
        elif k % 7 == 6:
            lines.append(json.dumps({"prompt": f"question {k - 1} {PAD}", "answer": "dup"}))  # a duplicate
        else:
            lines.append(json.dumps({"prompt": f"question {k} {PAD}", "answer": str(k)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def reference_pairs(path):
    """The usable rows as (question, answer, row index), by a plain read of the whole file: rows are the non-blank
    lines, a row needs a text prompt and an answer, and a repeated question keeps its first row."""
    out, seen, bad = [], set(), []
    rows = [line for line in path.read_text().split("\n") if line.strip()]
    for i, line in enumerate(rows):
        try:
            row = json.loads(line)
        except ValueError:
            bad.append(i)
            continue
        if "answer" not in row:
            bad.append(i)
            continue
        if row["prompt"] in seen:
            continue
        seen.add(row["prompt"])
        out.append((row["prompt"], row["answer"], i))
    return out, bad


def test_split_picks_the_documented_rows_and_parses_only_them(tmp_path, monkeypatch, capsys):
    path = write_dataset(tmp_path / "d.jsonl", 1200)
    ref, bad = reference_pairs(path)
    n, k, holdout, seed = len(ref), 4, 3, 5
    task = build_task("math", source=str(path), val_size=k, holdout_seed=holdout)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "d.jsonl" in err[0] and f"{len(bad)} of 1200 rows are bad" in err[0], err
    assert f"first bad row is index {bad[0]}" in err[0]

    # the documented rule: the val_size first of range(n) shuffled by Random(holdout_seed), in increasing order
    idx = list(range(n))
    random.Random(holdout).shuffle(idx)
    val_idx = sorted(idx[:k])
    train_ref = [p for i, p in enumerate(ref) if i not in set(val_idx)]
    random.Random(seed).shuffle(train_ref)  # the run seed orders the training rows

    parsed = []
    real = rows_mod.parse_json
    monkeypatch.setattr(rows_mod, "parse_json", lambda text: parsed.append(1) or real(text))
    train, val = task.split(seed)
    assert [(e.meta["question"], e.answer, e.meta["row"]) for e in val] == [ref[i] for i in val_idx]
    assert len(parsed) == k and len(train) == n - k  # the training rows are not read to count them
    assert [(e.meta["question"], e.answer, e.meta["row"]) for e in train] == train_ref
    assert len(parsed) == n  # read once, when first needed
    assert train[:3] == list(train)[:3] and train == list(train) and list(task.pairs) == ref

    path.write_text(path.read_text() + json.dumps({"prompt": "late", "answer": "1"}) + "\n")
    with pytest.raises(UserError, match=r"d\.jsonl' changed while erft was using it"):
        task.split(seed)


def test_loading_and_evaluating_holds_offsets_not_the_file(tmp_path):
    path = write_dataset(tmp_path / "big.jsonl", 3000)
    size = path.stat().st_size
    build_task("math", source=str(write_dataset(tmp_path / "warm.jsonl", 30)), val_size=2).split(0)  # imports
    tracemalloc.start()
    try:
        val = build_task("math", source=str(path), val_size=4).split(0)[1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(val) == 4
    assert size > 5_000_000 and peak < size / 4, (size, peak)  # the whole file was held ~6 times over before
