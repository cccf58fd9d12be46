"""The docs site builds strictly: a dead link, a missing anchor or a page left out of the nav fails
the suite, naming the page. And the docs' runnable blocks run: a fenced ```bash or ```python block
right after the comment `<!-- runnable -->`, in README.md or docs/*.md, is one test named PAGE:LINE."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
BLOCK_TIMEOUT_S = 60


def test_the_docs_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    warnings = [line for line in out.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert out.returncode == 0 and not warnings, "\n".join(warnings) or out.stderr[-2000:]
    assert (tmp_path / "site" / "config" / "index.html").is_file() and (tmp_path / "site" / "architecture" / "index.html").is_file()


def runnable_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, code) of each block marked runnable in `page`; a marker
    that is not followed by a ```bash or ```python block is an error naming its line."""
    lines = page.read_text().splitlines()
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        fence = lines[j] if j < len(lines) else ""
        indent = fence[: len(fence) - len(fence.lstrip())]
        lang = fence.strip()[3:].strip()
        if not fence.strip().startswith("```") or lang not in ("bash", "python"):
            raise ValueError(f"{name}:{i + 1}: {MARKER} is not followed by a ```bash or ```python block")
        end = j + 1
        while end < len(lines) and lines[end].rstrip() != indent + "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{name}:{j + 1}: the runnable block is never closed")
        blocks.append((j + 1, lang, textwrap.dedent("\n".join(lines[j + 1:end])) + "\n"))
    return blocks


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = {f"{page.relative_to(ROOT)}:{line}": (lang, code) for page in PAGES for line, lang, code in runnable_blocks(page)}


def test_the_docs_have_runnable_blocks():
    assert len(BLOCKS) >= 5, f"only {len(BLOCKS)} blocks are marked {MARKER}: {sorted(BLOCKS)}"


def test_a_marker_must_mark_a_bash_or_python_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"text\n\n{MARKER}\n\n  ```bash\n  echo indented\n  ```\n\n{MARKER}\n```python\nprint(1)\n```\n")
    assert runnable_blocks(page) == [(5, "bash", "echo indented\n"), (10, "python", "print(1)\n")]
    page.write_text(f"{MARKER}\n```yaml\na: 1\n```\n")
    with pytest.raises(ValueError, match="page.md:1: .* is not followed by a ```bash or ```python block"):
        runnable_blocks(page)
    page.write_text(f"{MARKER}\n```bash\necho never closed\n")
    with pytest.raises(ValueError, match="page.md:2: the runnable block is never closed"):
        runnable_blocks(page)


@pytest.mark.parametrize("where", sorted(BLOCKS, key=lambda where: (where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1]))))
def test_runnable_block(where, tmp_path):
    """Run the block in an empty directory, the suite's venv first on PATH and RAYTOOL_REPO the
    repository's root; it must exit 0 within BLOCK_TIMEOUT_S."""
    lang, code = BLOCKS[where]
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / ("block.sh" if lang == "bash" else "block.py")
    script.write_text(code)
    venv_bin = str(Path(sys.executable).parent)  # not resolved: the venv's python is a link to the base interpreter
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "RAYTOOL_REPO": str(ROOT),
           "VIRTUAL_ENV": str(Path(venv_bin).parent), "NO_COLOR": "1"}
    argv = ["bash", "-euo", "pipefail", str(script)] if lang == "bash" else [sys.executable, str(script)]
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{where}: the ```{lang} block ran past {BLOCK_TIMEOUT_S} s\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
    assert proc.returncode == 0, (f"{where}: the ```{lang} block exited {proc.returncode}\n--- block ---\n{code}"
                                  f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
