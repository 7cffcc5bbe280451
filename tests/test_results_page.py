"""The results pages: every link into experiments/RESULTS.md lands on one of its headings, the page
stays a curated page (under 30 KB), and every row of the published tables names the command that
reproduces it, which composes."""

import re
from pathlib import Path

import pytest

from flexgemma import compose

from conftest import ROOT  # noqa: E402 - the repository
RESULTS = ROOT / "experiments" / "RESULTS.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, only letters, digits, spaces, hyphens and underscores
    kept, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_slug_is_githubs():
    assert slug("2026-12-01 — GRPO through TRL on the H200 (issue 17)") == "2026-12-01--grpo-through-trl-on-the-h200-issue-17"


def test_every_link_into_results_lands_on_a_heading():
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", RESULTS.read_text(), re.M)}
    links = [(page.name, a) for page in PAGES for a in re.findall(r"RESULTS\.md#([\w-]+)", page.read_text())]
    assert links and [link for link in links if link[1] not in anchors] == []


def test_results_is_a_curated_page():
    assert RESULTS.stat().st_size < 30_000


def table_commands(page: Path) -> list[str]:
    """The last cell of every row of the page's results table: the overrides after `python -m flexgemma`."""
    text = page.read_text()
    head = "| `python -m flexgemma ...` |"
    assert head in text, page
    rows = text[text.index(head):].split("\n\n")[0].splitlines()[2:]
    return [re.search(r"`([^`]+)`", row.rsplit("|", 2)[-2]).group(1) for row in rows]


@pytest.mark.parametrize("page", ["README.md", "docs/results.md"])
def test_every_published_number_names_a_command_that_composes(page):
    commands = table_commands(ROOT / page)
    assert len(commands) >= 7
    for command in commands:
        # a sweep's first point: `-m key=a,b` composes as key=a
        overrides = [o.split(",")[0] for o in command.split() if o != "-m"]
        cfg = compose(overrides)
        assert cfg.preset.name or cfg.task.name.value == "grpo" or cfg.quant.method == "bnb4", command
