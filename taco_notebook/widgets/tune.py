"""The compression advisor's table as HTML, for a notebook: what ``taco.tune`` returned, drawn.

``widgets`` renders what it is handed: a :class:`~taco_notebook.comm.training.advisor.TuneResult` (its ``rows()``,
``best``, ``summary()``), never the ranks. ``%load_ext taco_notebook`` registers :func:`tune_html` as the
result's ``text/html`` formatter, so ``taco.tune(step, state)`` as a cell's last expression shows the table;
text mode shows ``str(result)``.
"""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["tune_html"]

_PAYS, _BEST, _REFUSED = "#e6f4ea", "#b7e1c1", "#fbeaea"


def _cells(row: dict[str, Any]) -> list[str]:
    from ..comm.training.advisor import format_bytes

    link, relative = row["link_bytes_per_s"], row["relative_slope"]
    return [row["candidate"], f"{row['step_seconds'] * 1e3:,.1f} ms", f"{row['speedup']:.2f}x",
            format_bytes(row["wire_bytes_per_step"]), "-" if link is None else f"{format_bytes(link)}/s",
            "-" if relative is None else f"{relative:.2f}", row["verdict"]]


def tune_html(result: Any) -> str:
    """One table (candidate, step time, speed-up, bytes per step, link rate, loss slope vs none, verdict), the
    recommended row highlighted, and the recommendation under it."""
    header = ["candidate", "step time", "speed-up", "bytes/step", "link rate", "loss slope vs none", "verdict"]
    lines = ['<div class="taco-tune">', f"<p>{escape(result.summary())}</p>",
             '<table style="border-collapse:collapse">',
             "<tr>" + "".join(f'<th style="padding:2px 8px;text-align:left">{escape(h)}</th>' for h in header)
             + "</tr>"]
    for row in result.rows():
        best = row["candidate"] == result.best and not result.diverged
        colour = _BEST if best else _PAYS if row["pays"] else _REFUSED if row["verdict"] != "baseline" else ""
        style = f' style="background:{colour}"' if colour else ""
        cells = "".join(f'<td style="padding:2px 8px">{"<b>" if best else ""}{escape(text)}{"</b>" if best else ""}'
                        f"</td>" for text in _cells(row))
        lines.append(f"<tr{style}>{cells}</tr>")
    footer = ("<code>--compression auto</code> is unchanged: fix the step, then tune again." if result.diverged
              else f"<code>--compression auto</code> uses <b>{escape(result.best)}</b> on this cluster.")
    lines += ["</table>", f"<p>{footer}</p>", "</div>"]
    return "\n".join(lines)
