"""`dvc plots show` writes a page that renders without network: the template in .dvc/html/
inlines vega, vega-lite and vega-embed instead of DVC's CDN script tags. (That a browser draws
the charts from it offline was checked with headless Chromium, network blocked; see the NOTICE
for where the libraries come from.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT_SRC = re.compile(r"<script[^>]*\bsrc\s*=", re.IGNORECASE)
LINK_HREF = re.compile(r"<link[^>]*\bhref\s*=\s*[\"']https?://", re.IGNORECASE)


@pytest.mark.skipif(shutil.which("dvc") is None, reason="needs the dvc command")
def test_plots_page_loads_nothing_from_the_network(repo_root: Path, tmp_path: Path):
    out = tmp_path / "plots"
    subprocess.run(
        ["dvc", "plots", "show", "-o", str(out)],
        cwd=repo_root,
        check=True,
        capture_output=True,
        text=True,
    )
    page = (out / "index.html").read_text(encoding="utf-8")
    assert not SCRIPT_SRC.search(page) and not LINK_HREF.search(page)
    assert "cdn.jsdelivr.net" not in page
    # The three libraries, inlined, each once, before the charts that call vegaEmbed.
    for name in ("vega 5.20.2", "vega-lite 5.2.0", "vega-embed 6.18.2"):
        assert page.count(f"/* {name} (BSD-3-Clause") == 1, name
    assert page.index("vega-embed 6.18.2") < page.index("vegaEmbed('#")
    # Every chart of dvc.yaml is on the page.
    assert page.count("vegaEmbed('#") == 9


def test_the_template_is_configured_and_licensed(repo_root: Path):
    config = (repo_root / ".dvc/config").read_text(encoding="utf-8")
    assert re.search(
        r"^\[plots\]\s*\n(?:\s*#.*\n)*\s*html_template = html/plots\.html", config, re.M
    )
    template = (repo_root / ".dvc/html/plots.html").read_text(encoding="utf-8")
    assert "{plot_divs}" in template and "{scripts}" not in template  # DVC adds no CDN tags
    notice = (repo_root / ".dvc/html/NOTICE").read_text(encoding="utf-8")
    for name in ("vega 5.20.2", "vega-lite 5.2.0", "vega-embed 6.18.2"):
        assert f"== {name} " in notice
    assert notice.count("Redistribution and use in source and binary forms") == 3
