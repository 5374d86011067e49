"""The report's token view: the responses of some groups token by token (``token_view.jsonl``,
``training.token_view``, as the report's record holds them: ``analysis.report_data``), each token coloured by its
entropy H or by S_c, the method's marks on it, its numbers on hover, the group's rewards and advantages beside each
response; the same prompt under two runs side by side; and the share of dropped tokens by token class and by
position.

The page stays a page without script (``report.page``): the switch between H and S_c is two radio buttons and
CSS, the steps and groups are ``<details>``. Token text is data: every string is escaped and its control
characters made visible (``common.text.visible``). Bounded: at most ``MAX_GROUPS`` groups and ``MAX_TOKENS``
tokens are drawn (the newest steps first); a note says what was left out.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from entropy_rft.common.text import table_cell, visible
from entropy_rft.report.html_parts import table_html

MAX_GROUPS = 24  # groups drawn on a page, all runs together
MAX_TOKENS = 12000  # tokens drawn on a page (each is a span of about 200 bytes)
STEPS_PER_RUN = 2  # the newest recorded steps of each run
MARK_STYLE = {"dropped": "dropped from the loss", "zeroed": "advantage zeroed (a minibatch rule)",
              "adjusted": "re-weighted", "clipped": "past PPO's clip after the update", "kept": "kept"}
CLASSES = ("digit", "word", "punctuation", "space", "special")
POSITIONS = ((0, 8), (8, 16), (16, 32), (32, 64), (64, None))

CSS = """
.tvmode{margin:0.4em 0}.tv .t{background:var(--h);padding:0 1px;border-radius:2px;white-space:pre-wrap}
#tv-sc:checked ~ .tvbody .t{background:var(--sc)}
.tv .m-dropped{text-decoration:line-through;outline:1px solid #b00}
.tv .m-zeroed{text-decoration:underline dashed #b00}.tv .m-adjusted{text-decoration:underline double #06c}
.tv .m-clipped{border-bottom:2px dotted #555}
.tv .resp{font-family:monospace;margin:0.2em 0 0.5em 0;line-height:1.7}
.tv .adv{font-family:sans-serif;font-size:85%;color:#333;margin-right:0.6em}
.tv .cmp{display:grid;grid-template-columns:1fr 1fr;gap:1em}.tv details{margin:0.3em 0}
.tv .legend span{padding:0 4px;margin-right:0.5em}
"""


def token_class(text: str) -> str:
    """digit, word, punctuation, space, or special (a tokenizer's named token such as ``<eos>``)."""
    t = text.strip()
    if len(t) > 2 and t.startswith("<") and t.endswith(">"):
        return "special"
    if not t:
        return "space"
    if any(c.isdigit() for c in t):
        return "digit"
    if any(c.isalpha() for c in t):
        return "word"
    return "punctuation"


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _colour_h(h: float | None, top: float) -> str:
    if h is None:
        return "#eee"
    a = max(0.0, min(1.0, h / top)) if top > 0 else 0.0
    return f"rgba(255,140,0,{a:.2f})"


def _colour_sc(sc: float | None, top: float) -> str:
    if sc is None:
        return "#eee"
    a = max(-1.0, min(1.0, sc / top)) if top > 0 else 0.0
    return f"rgba(220,40,40,{a:.2f})" if a >= 0 else f"rgba(40,90,220,{-a:.2f})"


def _text(t: Any) -> str:
    return html.escape(visible(str(t).replace("\n", "⏎")))


def _response_html(resp: dict[str, Any], top_h: float, top_sc: float) -> tuple[str, int]:
    toks = resp.get("tokens") or []
    n = len(toks)
    col: dict[str, list[Any]] = {}
    for k in ("h", "sc", "s", "logp", "mark"):
        v = resp.get(k)
        col[k] = v if isinstance(v, list) else []
    spans = []
    for i, tok in enumerate(toks):
        h, sc, s, lp = (_num(col[k][i]) if i < len(col[k]) else None for k in ("h", "sc", "s", "logp"))
        mark = col["mark"][i] if i < len(col["mark"]) and col["mark"][i] in MARK_STYLE else "kept"

        def f(x: float | None) -> str:
            return "–" if x is None else f"{x:.3f}"

        title = f"H {f(h)} · S_c {f(sc)} · S* {f(s)} · log p {f(lp)} · {mark} · position {i}"
        spans.append(f'<span class="t m-{mark}" style="--h:{_colour_h(h, top_h)};--sc:{_colour_sc(sc, top_sc)}" '
                     f'title="{html.escape(title)}">{_text(tok)}</span>')
    reward, adv = _num(resp.get("reward")), _num(resp.get("adv"))
    head = (f'<span class="adv">reward {"–" if reward is None else f"{reward:g}"} · A '
            f'{"–" if adv is None else f"{adv:+.3f}"}</span>')
    return f'<div class="resp">{head}{"".join(spans)}</div>', n


def _group_html(label: str, row: dict[str, Any], top_h: float, top_sc: float) -> tuple[str, int]:
    parts, n = [], 0
    for resp in row["responses"]:
        if isinstance(resp, dict):
            text, k = _response_html(resp, top_h, top_sc)
            parts.append(text)
            n += k
    head = (f"<p><b>{_text(label)}</b>, step {row['step']}, group {_text(row.get('group'))}: "
            f"<code>{_text(row.get('prompt', ''))}</code></p>")
    return head + "".join(parts), n


def _scales(rows: Sequence[dict[str, Any]]) -> tuple[float, float]:
    hs, scs = [], []
    for row in rows:
        for resp in row["responses"]:
            if isinstance(resp, dict):
                hs += [x for x in map(_num, resp.get("h") or []) if x is not None]
                scs += [abs(x) for x in map(_num, resp.get("sc") or []) if x is not None]
    return (max(hs) if hs else 1.0), (max(scs) if scs else 1.0)


def dropped_shares(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The share of tokens a method took out of the loss (dropped or zeroed), by token class and by position
    bucket: ``{"class": {name: [dropped, total]}, "position": {"0-7": [dropped, total], ...}}``."""
    by_class: dict[str, list[int]] = {c: [0, 0] for c in CLASSES}
    by_pos: dict[str, list[int]] = {_bucket(lo, hi): [0, 0] for lo, hi in POSITIONS}
    for row in rows:
        for resp in row["responses"]:
            if not isinstance(resp, dict):
                continue
            marks = resp.get("mark") or []
            for i, tok in enumerate(resp.get("tokens") or []):
                out = int(i < len(marks) and marks[i] in ("dropped", "zeroed"))
                for slot in (by_class[token_class(str(tok))], by_pos[_position(i)]):
                    slot[0] += out
                    slot[1] += 1
    return {"class": by_class, "position": by_pos}


def _bucket(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"


def _position(i: int) -> str:
    return next(_bucket(lo, hi) for lo, hi in POSITIONS if hi is None or i < hi)


def token_view_section(views: Sequence[tuple[Any, Sequence[dict[str, Any]]]]) -> tuple[str, dict[str, Any]]:
    """The page's token view and its numbers (``report.json``'s ``token_view``): ``views`` are the report's runs
    with a token view (their ``name``, ``label``) and its rows (``analysis.report_data.ReportData.views``)."""
    if not views:
        return "", {"runs": [], "left_out": 0}
    chosen: list[tuple[Any, dict[str, Any]]] = []
    total = 0
    for r, rows in views:
        steps = sorted({row["step"] for row in rows})[-STEPS_PER_RUN:]
        for step in reversed(steps):
            chosen += [(r, row) for row in rows if row["step"] == step]
        total += len(rows)
    top_h, top_sc = _scales([row for _, row in chosen])
    drawn: list[tuple[Any, dict[str, Any], str]] = []
    tokens, left = 0, 0
    for r, row in chosen:
        if len(drawn) >= MAX_GROUPS or tokens >= MAX_TOKENS:
            left += 1
            continue
        text, n = _group_html(f"{r.name} ({r.label})", row, top_h, top_sc)
        drawn.append((r, row, text))
        tokens += n
    left += total - len(chosen)
    by_run: dict[str, list[str]] = defaultdict(list)
    for r, row, text in drawn:
        by_run[r.name].append(f"<details{' open' if not by_run[r.name] else ''}><summary>step {row['step']}, group "
                              f"{_text(row.get('group'))}</summary>{text}</details>")
    body = "".join(f"<h3>{_text(name)}</h3>{''.join(parts)}" for name, parts in by_run.items())
    body += _comparison_html(drawn)
    shares = {name: dropped_shares([row for r, row, _ in drawn if r.name == name]) for name in by_run}
    body += _shares_html(shares)
    legend = ('<p class="legend">Colour: <span style="background:rgba(255,140,0,1)">high H</span>'
              '<span style="background:rgba(220,40,40,1)">S_c &gt; 0</span>'
              '<span style="background:rgba(40,90,220,1)">S_c &lt; 0</span> (H from 0 to '
              f"{top_h:.2f} nats; |S_c| up to {top_sc:.3f}). Marks: "
              + "".join(f'<span class="t m-{m}">{html.escape(m)}</span>' for m in MARK_STYLE)
              + ". Hover a token for its numbers.</p>")
    note = (f'<p class="warn">Left out: {left} of {total} recorded groups (the page draws the newest '
            f"{STEPS_PER_RUN} recorded steps of each run, at most {MAX_GROUPS} groups and {MAX_TOKENS} tokens).</p>"
            if left else "")
    out = ('<h2 id="tokens">Tokens</h2><p>Some groups of the recorded steps (<code>probe.view_every</code>), response '
           "by response: each token coloured by its entropy H or by S_c (the switch), the method's marks on it, "
           "its numbers on hover, and each response's reward and advantage. The marks: dropped (the method's "
           "rollout rule took it out of the loss), zeroed (a minibatch rule zeroed its advantage), adjusted "
           "(re-weighted), clipped (past PPO's clip after the update, on the side its advantage pushes). A TRL "
           "run shows what the plug-in sees at its rollout stage (dropped or kept, no reward).</p>"
           + note + '<div class="tv"><input type="radio" name="tvmode" id="tv-h" checked><label for="tv-h">colour '
           'by H</label> <input type="radio" name="tvmode" id="tv-sc"><label for="tv-sc">colour by S_c</label>'
           f'<div class="tvbody">{legend}{body}</div></div>')
    numbers = {"runs": list(by_run), "groups_drawn": len(drawn), "tokens_drawn": tokens, "left_out": left,
               "dropped_shares": shares}
    return out, numbers


def _comparison_html(drawn: Sequence[tuple[Any, dict[str, Any], str]]) -> str:
    """The same prompt at the same step under runs of different series, side by side (two at a time)."""
    by_key: dict[tuple[int, str], list[tuple[Any, str]]] = defaultdict(list)
    for r, row, text in drawn:
        by_key[(row["step"], str(row.get("prompt", "")))].append((r, text))
    blocks = []
    for (step, prompt), items in by_key.items():
        labels = {r.label for r, _ in items}
        if len(labels) < 2:
            continue
        first: dict[str, str] = {}
        for r, text in items:
            first.setdefault(r.label, text)
        pair = list(first.items())[:2]
        blocks.append(f"<details><summary>step {step}: <code>{_text(prompt)}</code> under "
                      f"{' and '.join(_text(lab) for lab, _ in pair)}</summary><div class=\"cmp\">"
                      + "".join(f"<div>{text}</div>" for _, text in pair) + "</div></details>")
    if not blocks:
        return ""
    return "<h3>The same prompt under two runs</h3>" + "".join(blocks)


def _shares_html(shares: dict[str, dict[str, Any]]) -> str:
    if not shares:
        return ""

    def cell(v: list[int]) -> str:
        return "–" if not v[1] else f"{v[0] / v[1]:.1%} of {v[1]}"

    head = "| run | " + " | ".join(CLASSES) + " | " + " | ".join(f"pos {k}" for k in shares[next(iter(shares))]
                                                                    ["position"]) + " |\n|---|\n"
    lines = [f"| {table_cell(name)} | " + " | ".join(cell(s["class"][c]) for c in CLASSES) + " | "
             + " | ".join(cell(v) for v in s["position"].values()) + " |" for name, s in shares.items()]
    return ("<h3>Dropped or zeroed tokens, by class and position</h3><p>Over the groups drawn above: the share of "
            "each class of token (and of each position in the response) that the method took out of the loss.</p>"
            + table_html(head + "\n".join(lines)))
