"""The page template that lets `dvc plots show` draw offline (rlhf_pipeline.plots_page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from headless_browser import DVC_PLOTS, DVC_PLOTS_DRAWN, HeadlessChromium, page_url

from rlhf_pipeline.plots_page import TEMPLATE_PATH, offline_page_template

REPO = Path(__file__).resolve().parents[1]


def test_the_project_config_points_dvc_at_the_committed_template_which_is_current():
    from dvc.config import Config

    configured = Config(dvc_dir=str(REPO / ".dvc"), validate=False).load_one("repo")["plots"]["html_template"]
    assert (REPO / ".dvc" / configured) == REPO / TEMPLATE_PATH
    committed = (REPO / TEMPLATE_PATH).read_text(encoding="utf-8")
    assert committed == offline_page_template()  # `rlhf plots-page` was run after the last bundle change
    assert "{plot_divs}" in committed and "{scripts}" not in committed  # DVC's CDN tags never go in
    assert re.findall(r"""<(?:script|link)[^>]*(?:src|href)\s*=""", committed) == []


@pytest.mark.e2e
def test_a_page_from_the_template_draws_offline_and_dvc_s_own_page_does_not(chromium, tmp_path):
    """The same plot, in DVC's default page (vega from a CDN) and in ours, with no network."""
    from dvc_render.html import PAGE_HTML, render_html
    from dvc_render.vega import VegaRenderer

    points = [{"step": i, "score": float(i * i)} for i in range(5)]
    renderer = VegaRenderer(points, "score.tsv", x="step", y="score")
    ours = render_html([renderer], tmp_path / "ours.html", html_template=str(REPO / TEMPLATE_PATH))
    default = render_html([renderer], tmp_path / "default.html", html_template=PAGE_HTML)
    with HeadlessChromium(chromium) as browser:
        drawn = browser.load(page_url(Path(ours)), DVC_PLOTS, DVC_PLOTS_DRAWN, timeout_s=30)
        blank = browser.load(page_url(Path(default)), DVC_PLOTS, DVC_PLOTS_DRAWN, timeout_s=5)
    assert drawn.result["charts"] == [["score_tsv", True]] and drawn.failed == drawn.errors == []
    assert blank.result["charts"] == [["score_tsv", False]]
    assert any("cdn.jsdelivr.net" in url for url in blank.requested) and blank.failed and blank.errors
