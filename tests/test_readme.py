"""The README is for users and stays true: short, its Contents the sections it has, its Layout every
module there is, and every link it (or a guide in docs/) gives reaching a file and a heading."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 500


def headings(text: str, level: str = "#") -> list[str]:
    """The markdown headings of ``text`` (outside code blocks) whose marks are ``level`` or deeper."""
    found, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"^{level}#* ", line):
            found.append(line)
    return found


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_contents_lists_every_section_and_only_those():
    text = README.read_text()
    listed = re.findall(r"^- \[[^\]]+\]\(#([\w\-]+)\)$", section(text, "Contents"), re.M)
    sections = [anchor(h) for h in headings(text, "##") if h.startswith("## ") and h != "## Contents"]
    assert listed == sections


def test_layout_names_every_module():
    layout = section(README.read_text(), "Layout")
    words = set(re.findall(r"[\w]+", layout))
    missing = []
    for path in [*(REPO / "rlhf_pipeline").rglob("*.py"), *(REPO / "flows").rglob("*.py")]:
        parts = path.relative_to(REPO).with_suffix("").parts[1:]  # the package's own name aside
        names = [p for p in parts if p != "__init__"]
        if any(name not in words for name in names):
            missing.append(path.relative_to(REPO).as_posix())
    assert missing == [], f"modules the README's Layout does not name: {missing}"


def test_no_link_misses_its_closing_bracket():
    """``[text(path)`` renders as text, not a link: a bracket opened before a file's path in parentheses
    on the same line must be closed right before it."""
    documents = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "bench").rglob("*.md"))]
    unclosed = []
    for document in documents:
        for number, line in enumerate(document.read_text().splitlines(), 1):
            for match in re.finditer(r"(?<!\])\(((?:\.\./)*[\w./-]+\.(?:md|png|json|py|yaml|html|txt))\)", line):
                before = line[: match.start()]
                if before.count("[") > before.count("]"):
                    unclosed.append(
                        f"{document.relative_to(REPO)}:{number}: {line[max(0, match.start() - 40) : match.end()]}"
                    )
    assert unclosed == []


def test_every_link_reaches_its_file_and_heading():
    """In the README, the guides and the bench reports (whose index, bench/results/README.md, links them all)."""
    documents = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "bench").rglob("*.md"))]
    broken = []
    for document in documents:
        for link in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = link.partition("#")
            target = (document.parent / path).resolve() if path else document
            if not target.exists():
                broken.append(f"{document.name}: {link} (no such file)")
            elif fragment and target.suffix == ".md" and fragment not in map(anchor, headings(target.read_text())):
                broken.append(f"{document.name}: {link} (no such heading)")
    assert broken == []


def test_bench_results_is_an_index_of_current_reports():
    """bench/results/ keeps one current report per bench or study (older runs live in git history),
    at most 40 files, each listed in its index."""
    results = REPO / "bench" / "results"
    files = sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())
    assert len(files) <= 40, f"{len(files)} files in bench/results: keep the current report of each bench"
    index = (results / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#\s]+)\)", index))
    assert [f for f in files if f != "README.md" and f not in linked] == []
