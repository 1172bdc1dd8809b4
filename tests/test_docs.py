"""The documents a newcomer reads: a short README with the results summary taken from
docs/results.md, a license, results.md a reference of bounded length that opens with its summary,
and every link between the documents leading somewhere."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def test_the_readme_is_short_and_licensed():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()


def test_results_is_a_bounded_reference_that_opens_with_its_summary():
    text = (ROOT / "docs" / "results.md").read_text()
    assert len(text.splitlines()) <= 520
    assert re.findall(r"^## (.*)$", text, re.M)[0] == "Summary"


def test_the_readme_shows_the_results_summary_from_results_md():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "sync_readme.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


def test_every_link_between_the_documents_leads_somewhere():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            where = (doc.parent / path).resolve() if path else doc
            if not where.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert broken == []


def test_every_environment_variable_read_is_in_the_guides_table_and_no_other():
    """The names the library reads (a quoted "OVERCAST_..." in its Python or C) against the
    rows of docs/guide.md's table of them."""
    read = set()
    for source in [*(ROOT / "overcast").rglob("*.py"), *(ROOT / "overcast").rglob("*.[ch]")]:
        read |= set(re.findall(r"[\"'](OVERCAST_[A-Z0-9_]+)[\"']", source.read_text()))
    guide = (ROOT / "docs" / "guide.md").read_text()
    table = guide.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {name for line in table.splitlines() if line.startswith("| `OVERCAST_")
            for name in re.findall(r"`(OVERCAST_[A-Z0-9_]+)`", line.split(" | ")[0])}
    assert read == rows, (f"read but not in the table: {sorted(read - rows)}; "
                          f"in the table but not read: {sorted(rows - read)}")


def test_status_has_one_short_line_per_capability():
    rows = [line for line in (ROOT / "docs" / "status.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| capability")]
    assert rows and max(len(row) for row in rows) <= 250
