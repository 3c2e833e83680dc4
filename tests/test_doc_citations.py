"""Every place the code, the tests, the charts or the docs cite a design document points at a file and a heading
that exist in this repository: `docs/NAME.md#anchor` in any tracked file, and relative `[text](NAME.md#anchor)`
links between the markdown files. Anchors are GitHub's heading slugs. The design the code once cited from outside
the repository (`DESIGN.md`) is no citation at all here."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_CITATION = re.compile(r"(?<![\w/.])docs/([\w-]+\.md)(?:#([\w-]+))?")
MARKDOWN_LINK = re.compile(r"\]\(((?:\.\./)*[\w./-]*?[\w-]+\.md)(?:#([\w-]+))?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, dots, slashes, parentheses) dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a file's headings (those in code fences are not headings); a repeated heading's later
    anchors get -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        base = slug(heading.group(1))
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    files = []
    for name in listed:
        path = REPO / name
        if path.is_file() and path.suffix not in {".png", ".safetensors", ".gz", ".tgz"}:
            files.append(path)
    return files


def _broken(target: Path, anchor: str | None) -> str | None:
    if not target.is_file():
        return f"no file {target.relative_to(REPO)}"
    if anchor and anchor not in anchors(target.read_text()):
        return f"no heading #{anchor} in {target.relative_to(REPO)}"
    return None


def test_slugs_are_githubs() -> None:
    assert slug("Autotuning (`spec.autotune`)") == "autotuning-specautotune"
    assert slug("The tuner against the simulator: `npuserve tune --simulate`") == (
        "the-tuner-against-the-simulator-npuserve-tune---simulate")
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}


def test_every_citation_points_at_a_file_and_heading_that_exist() -> None:
    problems = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():  # its docstring names the forms
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        where = path.relative_to(REPO)
        for number, line in enumerate(text.splitlines(), 1):
            if "DESIGN.md" in line:
                problems.append(f"{where}:{number}: cites DESIGN.md, which is not in this repository")
            for match in DOC_CITATION.finditer(line):
                broken = _broken(REPO / "docs" / match.group(1), match.group(2))
                if broken:
                    problems.append(f"{where}:{number}: {match.group(0)}: {broken}")
            if path.suffix == ".md":
                for match in MARKDOWN_LINK.finditer(line):
                    if match.group(1).startswith(("http", "docs/")):
                        continue
                    broken = _broken((path.parent / match.group(1)).resolve(), match.group(2))
                    if broken:
                        problems.append(f"{where}:{number}: {match.group(0)}: {broken}")
    assert not problems, "\n".join(problems)
