"""GX Data Docs that render on a node without network.

GX pages load Bootstrap, jQuery, Font Awesome and Vega from CDNs and a logo from S3. On an
offline node the browser waits on those requests and shows a blank page. `make_offline`
removes every external stylesheet and script, points the logo at the copy that ships in the
great_expectations package, and links a small local stylesheet (`static/styles/offline.css`)
with the layout rules the pages need. GX inlines its own styles, so the pages keep them.
Interactive extras (sortable tables, Vega charts) need the CDN scripts and are left out.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

from draftline.runtime import atomic

# <script src="https://..."></script> and <link ... href="https://...">: assets, not links.
EXTERNAL_ASSET = re.compile(
    r'<(?:script|link)\b[^>]*?\b(?:src|href)\s*=\s*["\']https?://[^>]*>(?:\s*</script>)?',
    re.IGNORECASE,
)
REMOTE_LOGO = re.compile(
    r"https://great-expectations-web-assets\.[^\"')\s]+?\.png(?:\?[^\"')\s]*)?"
)
LOGO = "images/logo-long.png"
STYLESHEET = "styles/offline.css"

OFFLINE_CSS = """\
/* Written by draftline (data_docs.py): the few Bootstrap rules the Data Docs layout uses,
   so the pages read well without the CDN stylesheets. */
body { margin: 0; font-family: system-ui, -apple-system, "Segoe UI", sans-serif;
       font-size: 0.9rem; line-height: 1.45; color: #212529; background: #fff; }
.container, .container-fluid { padding: 0 1rem; }
.row { display: flex; flex-wrap: wrap; margin: 0 -0.5rem; }
[class*="col-"] { flex: 1 1 0; min-width: 0; padding: 0 0.5rem; box-sizing: border-box; }
.col-12, .col-md-12 { flex: 0 0 100%; }
.col-md-2, .col-lg-2 { flex: 0 0 18%; }
.card { border: 1px solid #dee2e6; border-radius: 0.25rem; margin: 0.75rem 0; }
.card-header { background: #f7f7f9; padding: 0.5rem 0.75rem; border-bottom: 1px solid #dee2e6; }
.card-body { padding: 0.75rem; }
table { border-collapse: collapse; width: 100%; margin: 0.5rem 0; }
th, td { border: 1px solid #dee2e6; padding: 0.3rem 0.5rem; text-align: left;
         vertical-align: top; }
thead th { background: #f1f3f5; }
.badge { display: inline-block; padding: 0.1rem 0.4rem; border-radius: 0.25rem;
         background: #e9ecef; font-size: 0.8rem; }
.text-success { color: #198754; } .text-danger { color: #dc3545; }
.nav, .navbar-nav { list-style: none; padding-left: 0; }
.nav-link { display: block; padding: 0.15rem 0; }
img { max-width: 100%; }
.d-none { display: none; }
.d-flex { display: flex; align-items: center; }
.sticky-top { position: sticky; top: 0; z-index: 10; background: #fff; }
/* Font Awesome is not available offline: the status icons become characters. */
.fas, .far, .fa { font-style: normal; }
.fa-check-circle::before { content: "\\2713"; }
.fa-times-circle::before, .fa-times::before { content: "\\2717"; }
"""


def make_offline(docs_dir: str | os.PathLike[str]) -> None:
    """Rewrite every page under `docs_dir` to use local assets only (see module docstring)."""
    docs = Path(docs_dir)
    static = docs / "static"
    logo = resources.files("great_expectations") / "render/view/static/images/logo-long.png"
    (static / LOGO).parent.mkdir(parents=True, exist_ok=True)
    (static / LOGO).write_bytes(logo.read_bytes())
    atomic.write_text(static / STYLESHEET, OFFLINE_CSS)
    for page in docs.rglob("*.html"):
        prefix = Path(os.path.relpath(static, page.parent)).as_posix()
        text = EXTERNAL_ASSET.sub("", page.read_text(encoding="utf-8"))
        text = REMOTE_LOGO.sub(f"{prefix}/{LOGO}", text)
        link = f'<link rel="stylesheet" href="{prefix}/{STYLESHEET}">\n'
        text = text.replace("</head>", link + "</head>", 1)
        atomic.write_text(page, text)
