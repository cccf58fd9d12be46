"""The docs site builds strictly: a dead link, a missing anchor or a page left out of the nav fails
the suite, naming the page."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    warnings = [line for line in out.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert out.returncode == 0 and not warnings, "\n".join(warnings) or out.stderr[-2000:]
    assert (tmp_path / "site" / "config" / "index.html").is_file() and (tmp_path / "site" / "architecture" / "index.html").is_file()
