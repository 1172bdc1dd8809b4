"""The house's layout: every package and module of overcast listed in CONTRIBUTING.md's layout
table, every import pointing down that list (function-level imports too), and no library file
longer than a reader can hold."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "overcast"
LONGEST = 800  # lines


def layers() -> list[str]:
    """CONTRIBUTING.md's layout table, top to bottom: 'cli', 'comm.py', ..."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("## Layout"):].split("\n\n")[2]
    return re.findall(r"^\| `overcast/([\w.]+)` \|", table, re.M)


def unit_of(module: str) -> str:
    """The layout's unit of a dotted module name (the package itself is comm.py's face)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "comm.py"
    name = parts[1]
    return name if (PACKAGE / name).is_dir() else f"{name}.py"


def imports() -> set[tuple[str, str, str]]:
    """(importing unit, imported unit, file) for every import of overcast in overcast."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        source = "comm.py" if module in ("overcast.__init__", "overcast") else unit_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] if node.module != "overcast" else \
                    [f"overcast.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "overcast" or name.startswith("overcast."):
                    target = unit_of(name)
                    if target != source:
                        found.add((source, target, str(path.relative_to(ROOT))))
    return found


def test_every_part_of_the_house_is_in_the_layout_table():
    listed = layers()
    parts = {p.name if p.is_dir() else p.name for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or
             (p.suffix == ".py" and p.name != "__init__.py")}
    assert sorted(parts - set(listed)) == [] and sorted(set(listed) - parts) == []


def test_imports_point_down_the_layout_only():
    order = {name: i for i, name in enumerate(layers())}
    upward = sorted(f"{where}: {src} imports {dst}" for src, dst, where in imports()
                    if order[src] > order[dst])
    assert upward == []


def test_no_library_file_is_longer_than_800_lines():
    files = [*PACKAGE.rglob("*.py"), *(PACKAGE / "native").rglob("*.[ch]")]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > LONGEST}
    assert long == {}
