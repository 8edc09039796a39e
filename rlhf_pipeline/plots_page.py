"""The HTML page template that makes ``dvc plots show`` and ``dvc plots diff`` draw offline.

DVC's own page loads vega, vega-lite and vega-embed from a CDN, so without a network it is blank.
``.dvc/config`` points ``plots.html_template`` at the template written here instead: the same
placeholders DVC fills (``{plot_divs}``, ``{refresh_tag}``), with the three libraries inlined as
one script built by ``vl-convert-python`` (a maintained bundle of exactly those libraries; it
assigns ``vegaEmbed`` to ``window``, which DVC's plot divs call). ``{scripts}`` is left out, so
DVC's CDN tags are never added. The template is committed; ``rlhf plots-page`` regenerates it.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.errors import MissingPackageError
from rlhf_pipeline.io import atomic_file

TEMPLATE_PATH = ".dvc/plots/offline_page.html"  # the .dvc/config entry is relative to .dvc/
# DVC's plot specs declare Vega-Lite v5 (`$schema: .../vega-lite/v5.json`): bundle the last 5.x
VEGA_LITE_VERSION = "v5.21"

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>RLHF pipeline plots</title>
    <!-- vega %(vega)s, vega-lite %(vega_lite)s, vega-embed %(vega_embed)s, bundled by vl-convert-python %(vlc)s:
         written by `rlhf plots-page`, so the page draws with no network -->
    <script type="text/javascript">
%(bundle)s
    </script>
    <style>
        body { font-family: sans-serif; }
        table { border-spacing: 15px; }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def offline_page_template() -> str:
    """DVC's page template with vega, vega-lite and vega-embed inlined."""
    try:
        import vl_convert
    except ImportError as error:
        raise MissingPackageError(
            f"{error}: writing the offline plots page needs vl-convert-python, which bundles vega, vega-lite and "
            "vega-embed. Install the project's dev extra (`pip install -e '.[dev]'`)."
        ) from None
    bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE_VERSION)
    placeholders = ("{plot_divs}", "{refresh_tag}", "{scripts}", "</script")
    if any(p in bundle for p in placeholders):  # DVC substitutes these; a script must not close early
        raise RuntimeError(f"the vl-convert bundle contains one of {placeholders}; it cannot be inlined as is")
    return PAGE % {
        "vega": vl_convert.get_vega_version(),
        "vega_lite": VEGA_LITE_VERSION,
        "vega_embed": vl_convert.get_vega_embed_version(),
        "vlc": vl_convert.__version__,
        "bundle": bundle,
    }


def write_offline_page_template(root: str | Path = ".") -> Path:
    path = Path(root, TEMPLATE_PATH)
    with atomic_file(path, "wb") as handle:
        handle.write(offline_page_template().encode("utf-8"))
    return path
