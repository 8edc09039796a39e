"""Great Expectations Data Docs of a contract run: GX's own validation-result pages, made static.

GX renders each result with its Data Docs renderer (``ValidationResultsPageRenderer`` and
``DefaultJinjaPageView``, what a Data Docs site builder runs). Those pages load Bootstrap, jQuery,
Font Awesome, vega and a logo from CDNs, and the logo's URL carries the render time. Every table
and verdict is already in the HTML, so the pages here drop what they would fetch, replace the
icon font's status glyphs with characters and carry a small stylesheet: readable with no network,
and the same bytes for the same result (they are a cached DVC output: GX's random element ids are
numbered instead).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from rlhf_pipeline.errors import SettingsError
from rlhf_pipeline.io import atomic_dir

# a tag that makes the browser fetch something: a stylesheet, script or image from a URL, or one
# of the site's own static files (this is one page, not a site)
FETCHING_TAG = re.compile(
    r"<(?:link|script|img)\b[^>]*\b(?:href|src)=\"(?:https?:|//|\.\./)[^\"]*\"[^>]*>(?:\s*</script>)?", re.S
)
INLINE_SCRIPT = re.compile(r"<script\b[^>]*>.*?</script>", re.S)  # jQuery/Bootstrap calls: fail without them
STATUS_ICON = re.compile(r'<i class="fas (fa-[a-z-]+) text-(success|danger|warning)"[^>]*>\s*</i>')
GLYPHS = {"success": "✔", "danger": "✘", "warning": "!"}
NEWSLETTER = re.compile(r"<a\b[^>]*greatexpectations\.io/newsletter.*?</a>", re.S)
# GX names the collapsible blocks' elements with random UUIDs: numbered in order instead
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #1d2733; }
table { border-collapse: collapse; margin: .5rem 0 1.2rem; }
td, th { border: 1px solid #cfd6de; padding: .3rem .6rem; text-align: left; vertical-align: top; }
.status-success { color: #1a7f37; font-weight: bold; } .status-danger { color: #cf222e; font-weight: bold; }
.status-warning { color: #9a6700; font-weight: bold; } nav, .ge-index-page-site-name-title { display: none; }
code, .badge { font-family: ui-monospace, monospace; background: #f3f5f7; padding: 0 .2rem; }
</style>"""


def static_page(page: str) -> str:
    """A GX Data Docs page that fetches nothing and runs no script, its verdicts still shown."""
    page = FETCHING_TAG.sub("", page)
    page = INLINE_SCRIPT.sub("", page)
    page = NEWSLETTER.sub("", page)
    page = STATUS_ICON.sub(lambda m: f'<span class="status-{m[2]}">{GLYPHS[m[2]]}</span>', page)
    numbers: dict[str, str] = {}
    page = UUID.sub(lambda m: numbers.setdefault(m[0], f"block{len(numbers) + 1}"), page)
    return page.replace("</head>", f"{STYLE}\n</head>", 1)


def render_result(result: dict, heading: str = "") -> str:
    """GX's Data Docs page of one validation result (its JSON dict), made static, with ``heading``
    (what was validated: the file and the split) first on the page."""
    from great_expectations.core.expectation_validation_result import ExpectationSuiteValidationResultSchema
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    # Plain JSON values: an observed value GX computed with pandas is a numpy float, whose repr
    # ("np.float64(0.26)") GX's number formatter cannot parse: it logs a traceback and shows "--".
    plain = json.loads(json.dumps(result))
    loaded = ExpectationSuiteValidationResultSchema().load(plain)
    page = static_page(DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(loaded)))
    if heading:
        page = re.sub(r"(<body\b[^>]*>)", lambda m: f"{m[1]}\n<h1>{html.escape(heading)}</h1>", page, count=1)
    return page


def check_docs_folder(directory: str | Path) -> None:
    """Data Docs replace their folder whole, so they go only to a new or empty folder or over earlier
    Data Docs (``.html`` pages alone): ``rlhf validate-preferences data/labels/x.jsonl --docs data/labels``
    used to empty the labels folder, the file it validated with it. SettingsError otherwise, and for a path
    that is a file."""
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        # atomic_dir would refuse it too, but only once the contract has run and printed its verdict
        raise SettingsError(
            f"{folder} is a file, not a folder: Data Docs are a folder of pages, and writing them there would "
            "replace the file. Choose a folder's path; nothing was written."
        )
    if not folder.is_dir():
        return  # new: atomic_dir makes it
    others = sorted(p.name for p in folder.iterdir() if not (p.is_file() and p.suffix == ".html"))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise SettingsError(
            f"{folder} holds what is not a Data Docs page ({shown}): Data Docs replace their folder whole, so they "
            "are written to a new or empty folder, or over earlier Data Docs. Choose another folder; nothing was "
            "written."
        )


def write_data_docs(results: dict[str, dict], directory: str | Path, title: str) -> Path:
    """Data Docs for ``results`` (name -> GX result JSON, e.g. one per split) in ``directory`` (see
    :func:`check_docs_folder`): one page per result and an ``index.html`` with each verdict; written
    atomically. Returns the index."""
    check_docs_folder(directory)
    rows = []
    with atomic_dir(directory) as tmp:
        for name, result in results.items():
            (tmp / f"{name}.html").write_text(render_result(result, f"{title}, split {name}"), encoding="utf-8")
            stats = result.get("statistics", {})
            verdict = "passed" if result.get("success") else "FAILED"
            rows.append(
                f'<tr><td><a href="{html.escape(name)}.html">{html.escape(name)}</a></td>'
                f'<td class="status-{"success" if result.get("success") else "danger"}">{verdict}</td>'
                f"<td>{stats.get('successful_expectations')} of {stats.get('evaluated_expectations')}</td></tr>"
            )
        index = (
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>\n'
            f"{STYLE}\n</head><body>\n<h1>{html.escape(title)}</h1>\n"
            "<p>Great Expectations Data Docs of the preference-data contract, one page per split.</p>\n"
            "<table><tr><th>split</th><th>verdict</th><th>expectations met</th></tr>\n"
            + "\n".join(rows)
            + "\n</table>\n</body></html>\n"
        )
        (tmp / "index.html").write_text(index, encoding="utf-8")
    return Path(directory) / "index.html"
