"""Explanations (`app.explain.Note`) as plotly hover text: HTML, escaped, bold subjects."""

from __future__ import annotations

from app.explain import Note


def hover_html(text: Note | str) -> str:
    """A `Note` as plotly's hover HTML (lines by <br>, strong spans in <b>); a plain string,
    already hover text, as it is."""
    if isinstance(text, str):
        return text
    return "<br>".join(
        "".join(f"<b>{_escape(s.text)}</b>" if s.strong else _escape(s.text) for s in line)
        for line in text.lines
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
