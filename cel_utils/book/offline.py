"""A Sphinx extension (listed in ``_config.yml``) that makes the built site work with no network.

Jupyter Book 1.x loads MathJax from a CDN, and a plotly figure needs plotly.js. Both are served from the site's own
``_static/`` instead: MathJax 3 from the ``sphinx-mathjax-offline`` package (which bundles its files), plotly.js from the
``plotly`` package (the version that drew the figures). plotly.js is added only to pages that hold a figure: it is
several MB, and most pages have none. The figures themselves are written without any script source
(:mod:`cel_utils.book.interactive`), so nothing on a page points outside the site.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

MATHJAX_DIR = "mathjax"  # under _static/
MATHJAX_ENTRY = "tex-chtml.js"  # the component Sphinx loads: TeX input, CommonHTML output (fonts bundled beside it)
PLOTLY_JS = "plotly/plotly.min.js"  # under _static/
FIGURE_MARK = 'class="plotly-graph-div"'  # what plotly writes into every figure's container


def mathjax_source() -> Path:
    """The folder of MathJax 3 files shipped by the ``sphinx-mathjax-offline`` package."""
    spec = importlib.util.find_spec("sphinx-mathjax-offline")  # its import name has dashes: found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sphinx-mathjax-offline is not installed: pip install -e . installs it")
    folder = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax"
    if not (folder / MATHJAX_ENTRY).is_file():
        raise RuntimeError(f"no {MATHJAX_ENTRY} in {folder}")
    return folder


def plotly_source() -> Path:
    """plotly.min.js as shipped inside the ``plotly`` Python package."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError(f"no plotly.min.js in the plotly package ({path})")
    return path


def _use_local_mathjax(app, config) -> None:
    # A relative mathjax_path is resolved against _static/ by sphinx.ext.mathjax.
    config.mathjax_path = f"{MATHJAX_DIR}/{MATHJAX_ENTRY}"


def _is_thebe(script) -> bool:
    return getattr(script, "filename", None) == "sphinx-thebe.js" or "THEBE_JS_URL" in str(
        getattr(script, "attributes", {}).get("body", ""))


def _page_scripts(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if isinstance(scripts, list):
        # Live code cells (thebe) are off in _config.yml, and would load thebe from unpkg anyway; Jupyter Book still
        # adds thebe's set-up, twice, which a browser reports as a redeclared constant. Drop it.
        scripts[:] = [script for script in scripts if not _is_thebe(script)]
    if FIGURE_MARK in (context.get("body") or ""):
        # Called during html-page-context, this adds the script to this page only; loaded in <head>, before the
        # figures' inline scripts call Plotly.newPlot.
        app.add_js_file(PLOTLY_JS)


def copy_assets(outdir: Path) -> list[Path]:
    """Copy MathJax and plotly.js into ``<outdir>/_static``; returns what was written."""
    static = Path(outdir) / "_static"
    mathjax = static / MATHJAX_DIR
    shutil.copytree(mathjax_source(), mathjax, dirs_exist_ok=True)
    plotly_js = static / PLOTLY_JS
    plotly_js.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plotly_source(), plotly_js)
    return [mathjax, plotly_js]


def _copy_after_build(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        copy_assets(Path(app.outdir))
        _favicon_on_redirect(Path(app.outdir), app.config.html_favicon)


def _favicon_on_redirect(outdir: Path, favicon: str | None) -> None:
    """The site's index.html is a bare redirect written by sphinx-external-toc; without an icon link a browser asks for
    /favicon.ico at the server's root, outside a project site's sub-path."""
    index = outdir / "index.html"
    if not favicon or not index.is_file():
        return
    page = index.read_text(encoding="utf-8")
    if 'rel="icon"' not in page:
        link = f'<link rel="icon" href="_static/{Path(favicon).name}" />'
        page = page.replace("<head>", "<head>\n" + link, 1) if "<head>" in page else link + "\n" + page
        index.write_text(page, encoding="utf-8")


def setup(app) -> dict:
    mathjax_source(), plotly_source()  # fail at the start of a build, not after it, when a package is missing
    app.connect("config-inited", _use_local_mathjax)
    app.connect("html-page-context", _page_scripts)
    app.connect("build-finished", _copy_after_build, priority=900)  # after the toc writes index.html
    return {"parallel_read_safe": True, "parallel_write_safe": True}
