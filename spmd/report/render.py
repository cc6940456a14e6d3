"""Pictures of the sharded graph in files: `plan.visualize("gpt.svg")` / `compiled.visualize(...)`.

The drawing is `report/visualize.py`'s graphviz source; graphviz's `dot` renders it to .svg, .png or
.pdf. Without `dot` the `.dot` source is written instead, with how to install it; `.html` is a
self-contained page (the SVG inline when it can be rendered, and the plan in words).
"""
from __future__ import annotations

import html
import shutil
import subprocess
import warnings
from pathlib import Path

from spmd.report.explain import explain
from spmd.report.visualize import to_dot

INSTALL = ("graphviz's `dot` was not found on PATH. Install it (Debian/Ubuntu: `apt-get install -y graphviz`; "
           "macOS: `brew install graphviz`; conda: `conda install graphviz`) and render with `dot -Tsvg {dot} -o "
           "{out}`.")


class MissingGraphvizWarning(UserWarning):
    """The `dot` binary is missing: the picture was written as graphviz source instead."""


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _svg_body(svg: str) -> str:
    """An SVG document without its XML prolog, for inlining in HTML."""
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else svg


def _html(plan, source: str, svg: str | None, title: str) -> str:
    if svg is not None:
        picture = f'<div class="graph">{_svg_body(svg)}</div>'
    else:
        picture = (f"<p><b>{_esc(INSTALL.format(dot='plan.dot', out='plan.svg'))}</b></p>"
                   f"<details><summary>graphviz source</summary><pre>{_esc(source)}</pre></details>")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>body{{font-family:sans-serif;margin:1em}} "
            "pre{font-size:12px;overflow-x:auto} .graph svg{max-width:100%;height:auto}</style></head>\n"
            f"<body><h1>{_esc(title)}</h1>\n{picture}\n<h2>The plan</h2>\n<pre>{_esc(explain(plan, plan.details))}</pre>\n"
            "</body></html>\n")


def visualize(plan, sources, path, collapse: bool | None = None, views: bool = False, title: str | None = None) -> Path:
    """Draw the sharded graph of `plan` to `path`; the format follows the suffix: .svg, .png, .pdf (need
    graphviz's `dot`), .dot (graphviz source), .html (self-contained: the SVG inline when `dot` exists,
    else the source, plus the plan in words). `collapse`: fold runs of identical repeated blocks (None:
    runs of 4 or more; True: 2 or more; False: never). `views`: also draw views and getitem.
    Returns the path written (the .dot next to it when `dot` is missing)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".svg", ".png", ".pdf", ".dot", ".gv", ".html"):
        raise ValueError(f"visualize: unknown format {path.suffix!r}; use .svg, .png, .pdf, .dot or .html")
    source = to_dot(plan, sources, collapse, views, title)
    if suffix in (".dot", ".gv"):
        path.write_text(source)
        return path
    dot = shutil.which("dot")
    svg = None
    if dot is not None:
        fmt = "svg" if suffix == ".html" else suffix[1:]
        out = subprocess.run([dot, f"-T{fmt}"], input=source.encode(), capture_output=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"visualize: dot failed: {out.stderr.decode(errors='replace')}")
        if suffix != ".html":
            path.write_bytes(out.stdout)
            return path
        svg = out.stdout.decode()
    if suffix == ".html":
        path.write_text(_html(plan, source, svg, title or f"spmd plan on mesh {plan.mesh}"))
        if svg is None:
            warnings.warn(MissingGraphvizWarning(INSTALL.format(dot="<file>.dot", out="<file>.svg") +
                                                 f" {path} shows the source and the plan as text."), stacklevel=3)
        return path
    dot_path = path.with_suffix(".dot")
    dot_path.write_text(source)
    warnings.warn(MissingGraphvizWarning(f"wrote {dot_path} instead of {path}. " +
                                         INSTALL.format(dot=dot_path, out=path)), stacklevel=3)
    return dot_path
