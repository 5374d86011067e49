"""HTML pieces of the report: the page's CSS, a figure (PNG as a data URI) with its caption, a markdown table
as an HTML table that wraps, and the note for a figure left out."""

from __future__ import annotations

import base64
import html

from entropy_rft.common.text import table_row_cells

# The page fits ~1000 px: tables wrap (labels anywhere, headers after '/' and '_', a cell's '± std' onto a
# second line) and scroll inside their own box only if they still do not fit; figures scale to the width.
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1000px;margin:24px auto;
padding:0 16px;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:0.2em} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
.meta{color:#666;font-size:0.9em;overflow-wrap:anywhere} .summary{background:#f5f7fa;border-left:4px solid #4a78c2;
padding:10px 14px}
.tablewrap{max-width:100%;overflow-x:auto;margin:8px 0}
table{border-collapse:collapse;font-size:0.78em;width:100%}
th,td{border:1px solid #ccc;padding:2px 4px;text-align:right;white-space:normal}
th{background:#eef;vertical-align:bottom;font-weight:600}
td:first-child,th:first-child{text-align:left;overflow-wrap:anywhere;min-width:6em;max-width:16em}
td .sd{white-space:nowrap;color:#555}
figure{margin:10px 0 22px 0} figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#555;font-size:0.88em} .missing{color:#a33;font-style:italic}
.warn{color:#a33;font-weight:600}
"""


def img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def figure_html(png: bytes, title: str, caption_html: str) -> str:
    return f"<figure>{img(png, title)}<figcaption>{caption_html}</figcaption></figure>"


def not_shown_html(reason: str) -> str:
    return f'<p class="missing">Not shown: {html.escape(reason)}.</p>'


def table_html(md: str) -> str:
    lines = [ln for ln in md.strip().splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    if not lines:
        return ""
    cells = [table_row_cells(ln) for ln in lines]
    # Allow line breaks after '/' and '_' so long metric names wrap inside their column.
    head = "".join(f"<th>{html.escape(c).replace('/', '/<wbr>').replace('_', '_<wbr>')}</th>" for c in cells[0])

    def cell(c: str) -> str:
        mean, pm, std = c.partition(" ± ")
        return f"{html.escape(mean)} <span class=\"sd\">± {html.escape(std)}</span>" if pm else html.escape(c)

    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in cells[1:])
    return f'<div class="tablewrap"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
