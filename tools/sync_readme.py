#!/usr/bin/env python3
"""Copy docs/results.md's summary table (between <!-- summary --> and <!-- /summary -->) into
README.md, so that the README shows it from the one source; --check only says whether they
differ (exit 1 if they do). Run it whenever results.md's summary changes."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- summary -->\n.*?<!-- /summary -->", re.S)


def summary(text: str) -> str:
    found = BLOCK.search(text)
    if found is None:
        raise SystemExit("no <!-- summary --> ... <!-- /summary --> block")
    return found.group(0)


def main() -> int:
    results = summary((ROOT / "docs" / "results.md").read_text())
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    if summary(readme) == results:
        return 0
    if "--check" in sys.argv[1:]:
        print("README.md's results summary differs from docs/results.md's: run tools/sync_readme.py")
        return 1
    readme_path.write_text(BLOCK.sub(lambda _: results, readme, count=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
