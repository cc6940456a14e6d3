"""Pictures of the sharded graph in files: `plan.visualize("gpt.svg")` / `compiled.visualize(...)`.

The drawing is `report/visualize.py`'s graphviz source; a renderer turns it into .svg, .png or .pdf:
graphviz's `dot` when it is on PATH, else `graphviz-pure` (a pure-Rust port of dot installed by pip as a
dependency of spmd, so pictures work after a plain `pip install`; it writes no PDF yet). With neither,
or PDF asked of graphviz-pure, the `.dot` source is written instead with what to install; `.html` is a
self-contained page (the SVG inline when it can be rendered, and the plan in words).
"""
from __future__ import annotations

import html
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from spmd.report.explain import explain
from spmd.report.visualize import to_dot

GRAPHVIZ = ("Debian/Ubuntu: `apt-get install -y graphviz`; macOS: `brew install graphviz`; "
            "conda: `conda install graphviz`")
INSTALL = ("Neither graphviz's `dot` nor `graphviz-pure` was found (on PATH or next to {python}). `pip install "
           "graphviz-pure` (a dependency of spmd: reinstalling spmd brings it back) renders pictures with no system "
           "package; graphviz's own `dot` is preferred when on PATH (" + GRAPHVIZ + "). Then call visualize again, "
           "or render with `graphviz-pure -Tsvg {dot} -o {out}` (or `dot -Tsvg ...`).")
NO_PDF = ("wrote {dot} instead of {out}: graphviz-pure cannot write PDF ({why}). Ask for .svg or .png, or install "
          "graphviz, whose `dot` writes PDF and is preferred when on PATH (" + GRAPHVIZ + "), then "
          "`dot -Tpdf {dot} -o {out}`.")


class MissingGraphvizWarning(UserWarning):
    """No renderer could draw the picture (no `dot`, no `graphviz-pure`, or PDF without `dot`): the graphviz
    source was written instead."""


def find_renderer() -> tuple[str, str] | None:
    """(name, executable) of the program that renders graphviz source: `dot` when on PATH (the reference, and
    it writes PDF), else `graphviz-pure`, looked for where pip put this Python's scripts (a venv whose bin
    directory is not on PATH) and then on PATH. None when neither exists."""
    dot = shutil.which("dot")
    if dot is not None:
        return "dot", dot
    exe = "graphviz-pure.exe" if os.name == "nt" else "graphviz-pure"
    beside = dict.fromkeys([Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))])
    for folder in beside:  # a name with a folder in it: shutil.which checks that file only
        found = shutil.which(str(folder / exe))
        if found is not None:
            return "graphviz-pure", found
    found = shutil.which("graphviz-pure")
    return None if found is None else ("graphviz-pure", found)


LARGE = 400  # boxes past which `dot`'s layout search is bounded


def _render(renderer: tuple[str, str], source: str, fmt: str) -> bytes | str:
    """The picture in `fmt` as bytes, or why the renderer cannot write `fmt` (graphviz-pure and PDF)."""
    name, exe = renderer
    # (found by a probe: graphviz's crossing minimization ran 6+ minutes on a small T5's training plan, ~800 boxes;
    # bounded, the layout takes seconds and draws the same graph, with more crossings)
    bounded = ["-Gnslimit=1", "-Gnslimit1=1", "-Gmclimit=0.1"] if name == "dot" and source.count(" [label=") > LARGE else []
    out = subprocess.run([exe, f"-T{fmt}", *bounded], input=source.encode(), capture_output=True, check=False)
    if out.returncode == 0:
        return out.stdout
    err = out.stderr.decode(errors="replace").strip()
    if name == "graphviz-pure" and fmt == "pdf":  # "not supported yet" (0.2.2); tried so a later release works
        return err.splitlines()[0] if err else f"exit status {out.returncode}"
    raise RuntimeError(f"visualize: {name} ({exe}) failed to render -T{fmt} (exit status {out.returncode}): {err}\n"
                       "Write the graphviz source with a .dot path to render it by hand, or try the other renderer "
                       "(graphviz's `dot` is preferred when on PATH; `pip install graphviz-pure` otherwise).")


def _install(dot, out) -> str:
    return INSTALL.format(python=sys.executable, dot=dot, out=out)


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
        picture = (f"<p><b>{_esc(_install('plan.dot', 'plan.svg'))}</b></p>"
                   f"<details><summary>graphviz source</summary><pre>{_esc(source)}</pre></details>")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>body{{font-family:sans-serif;margin:1em}} "
            "pre{font-size:12px;overflow-x:auto} .graph svg{max-width:100%;height:auto}</style></head>\n"
            f"<body><h1>{_esc(title)}</h1>\n{picture}\n<h2>The plan</h2>\n<pre>{_esc(explain(plan, plan.details))}</pre>\n"
            "</body></html>\n")


PICTURE_FORMATS = (".svg", ".png", ".pdf", ".dot", ".gv", ".html")


def check_format(path) -> str:
    """`path`'s suffix, lower case, where `visualize` can write it; else a ValueError naming the formats."""
    suffix = Path(path).suffix.lower()
    if suffix not in PICTURE_FORMATS:
        raise ValueError(f"visualize: unknown format {Path(path).suffix!r}; use .svg, .png, .pdf, .dot or .html")
    return suffix


def visualize(plan, sources, path, collapse: bool | None = None, views: bool = False, title: str | None = None) -> Path:
    """Draw the sharded graph of `plan` to `path`; the format follows the suffix: .svg, .png (graphviz's
    `dot` or `graphviz-pure`), .pdf (`dot` only), .dot (graphviz source), .html (self-contained: the SVG
    inline when a renderer exists, else the source, plus the plan in words). `collapse`: fold runs of
    identical repeated blocks (None: runs of 4 or more; True: 2 or more; False: never). `views`: also
    draw views and getitem. Returns the path written (the .dot next to it when no renderer can draw it)."""
    path = Path(path)
    suffix = check_format(path)
    source = to_dot(plan, sources, collapse, views, title)
    if suffix in (".dot", ".gv"):
        path.write_text(source)
        return path
    renderer = find_renderer()
    picture = None if renderer is None else _render(renderer, source, "svg" if suffix == ".html" else suffix[1:])
    if suffix == ".html":
        svg = picture.decode() if isinstance(picture, bytes) else None
        path.write_text(_html(plan, source, svg, title or f"spmd plan on mesh {plan.mesh}"))
        if svg is None:
            warnings.warn(MissingGraphvizWarning(_install("<file>.dot", "<file>.svg") +
                                                 f" {path} shows the source and the plan as text."), stacklevel=3)
        return path
    if isinstance(picture, bytes):
        path.write_bytes(picture)
        return path
    dot_path = path.with_suffix(".dot")
    dot_path.write_text(source)
    why = (f"wrote {dot_path} instead of {path}. " + _install(dot_path, path) if picture is None
           else NO_PDF.format(dot=dot_path, out=path, why=picture))
    warnings.warn(MissingGraphvizWarning(why), stacklevel=3)
    return dot_path
