"""The README a new user reads first, and the docs beside it: the commands where a reader finds them, links that lead
somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
DEMO = "python3.11 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/dsv4 demo"
TESTS = "python3.11 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -q"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def lines_until(text: str, needle: str) -> int:
    """The 1-based line of the first occurrence of ``needle``."""
    return text[: text.index(needle)].count("\n") + 1


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert text.count("\n") <= 250
    assert lines_until(text, DEMO) <= 40 and lines_until(text, TESTS) <= 40


def test_readme_test_command_is_the_one_ci_runs():
    assert TESTS in (ROOT / ".ci" / "run").read_text()


def test_readme_gives_the_v4_flash_command_and_the_flag_table_early():
    text = README.read_text()
    assert lines_until(text, "--model-path /models/DeepSeek-V4-Flash --tp 8 --ep-size 8") <= 120
    assert lines_until(text, "| flag |") <= 120


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_lead_to_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                    broken.append(f"{page.name}: {target}")
    assert not broken, broken
