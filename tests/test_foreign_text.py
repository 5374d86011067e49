"""Issue 48, class 2: foreign text is shown, not obeyed.

A verl console log as a hostile sender would write it: metric keys holding an OSC window title, an OSC 8 link and
a bell; a run name with two ``$`` and a ``|``; a shared run whose ``model.name`` holds escapes. Nothing erft
prints holds a raw ESC or BEL byte, the figures draw the names literally and the tables keep their cells.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from entropy_rft.cli.main import main
from entropy_rft.common.text import mathtext_literal, table_cell, table_row_cells, visible

TITLE = "\x1b]0;pwned\x07"
LINK = "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"


def erft(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def raw_controls(text: str) -> bool:
    return bool(re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", text))


def console_log(path: Path, metric: str, entropy: str = "actor/entropy", steps: int = 12) -> Path:
    lines = []
    for s in range(1, steps + 1):
        h = 1.2 - 0.05 * s
        lines.append(f"(TaskRunner pid=1) step:{s} - {entropy}:{h:.4f} - {metric}:{0.9 - 0.4 * 2.718 ** h / 4:.4f}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_visible_escapes_every_control_character_and_keeps_text():
    assert visible(f"a{TITLE}b\n\t\u202e\x9b") == "a\\x1b]0;pwned\\x07b\\x0a\\x09\\u202e\\x9b"
    assert visible("entropy/mean ± é") == "entropy/mean ± é"
    assert mathtext_literal("qwen_$lr_$bs") == r"qwen_\$lr_\$bs"
    cell = table_cell("a|b\nc")
    assert cell == r"a\|b\x0ac" and table_row_cells(f"| {cell} | 2 |") == ["a|b\\x0ac", "2"]


def test_fit_law_prints_keys_of_a_hostile_log_visibly(tmp_path, capsys):
    log = console_log(tmp_path / "verl.log", f"val-core/{TITLE}{LINK}/acc/mean@1")
    rc, out, err = erft(capsys, "fit-law", log)
    assert rc == 0, err
    assert not raw_controls(out + err)
    assert "\\x1b]0;pwned\\x07" in out  # shown, escaped


def test_keys_found_error_line_is_visible(tmp_path, capsys):
    log = console_log(tmp_path / "verl.log", "val-core/x/acc/mean@1", entropy=f"ent{TITLE}")
    rc, out, err = erft(capsys, "fit-law", log)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "keys found" in err and not raw_controls(out + err)


def test_report_of_a_hostile_log_named_with_dollars_and_a_bar(tmp_path, capsys):
    log = console_log(tmp_path / "qwen_$lr_$bs|x.log", f"val-core/{TITLE}/acc/mean@1")
    rc, out, err = erft(capsys, "report", log, "--out", tmp_path / "rep")
    assert rc == 0, err
    assert not raw_controls(out + err)
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "\x1b" not in page and "\x07" not in page
    assert "<td>qwen_$lr_$bs|x.log</td>" in page  # one cell, the name as it is


def test_model_name_of_a_shared_run_is_shown_visibly(tmp_path, capsys):
    from entropy_rft.config.loading import load_config
    from entropy_rft.config.schema import config_to_dict

    data = config_to_dict(load_config(None, []))
    data["model"]["name"] = f"no/such{TITLE}model"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(data))
    rc, out, err = erft(capsys, "train", "--resume", run)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "no/such\\x1b]0;pwned\\x07model" in err and not raw_controls(out + err)


# ----------------------------------------------------------------------------- 5. one line, and the text that is


def test_report_of_foreign_runs_names_the_pass_at_k_it_has(tmp_path, capsys):
    logs = [console_log(tmp_path / f"run{i}.log", "val-core/d/acc/mean@1") for i in (1, 2)]
    rc, out, err = erft(capsys, "report", *logs, "--out", tmp_path / "rep")
    assert rc == 0, err
    assert "pass@None" not in out and "At the final evaluation pass@1 was " in out


def test_a_chat_template_that_fails_is_one_line():
    import pytest

    from entropy_rft.common.errors import UserError
    from entropy_rft.models.loading import build_char_tokenizer
    from entropy_rft.tasks.prompts import ChatPrompt, encode_prompt

    tok = build_char_tokenizer()
    tok.chat_template = "{{ messages.__class__.__mro__ }}"  # the sandbox refuses it: SecurityError
    with pytest.raises(UserError, match="chat template cannot render a prompt.*SecurityError") as e:
        encode_prompt(tok, ChatPrompt("hello"))
    assert "\n" not in str(e.value)


def test_braces_inside_a_dataset_question_are_kept():
    from entropy_rft.tasks.prompts import MATH_TEMPLATE, format_question

    text = format_question("Is {{}} the empty set {} here?", MATH_TEMPLATE)
    assert text.startswith("Is {{}} the empty set {} here?") and text.endswith("within \\boxed{}.")
