"""The house's layout: every package and module of overcast listed in CONTRIBUTING.md's layout
table, every import pointing down that list (function-level imports too), the native core's
includes pointing down its folders, and no library file longer than a reader can hold."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "overcast"
NATIVE = PACKAGE / "native"
NATIVE_TESTS = ROOT / "tests" / "native"
LONGEST = 800  # lines
# What each folder of the native core may include (CONTRIBUTING.md's layout): the binding any
# part, a side (rank or aggregator) its own folder and common, common only itself; nothing the
# binding, neither side the other. The core's C tests and fuzz targets (tests/native) may
# include any part but the binding: they test both sides and what they share, and are built
# without Python.
MAY_INCLUDE = {"binding": {"binding", "rank", "aggregator", "common"},
               "rank": {"rank", "common"}, "aggregator": {"aggregator", "common"},
               "common": {"common"}, "tests/native": {"tests/native", "rank", "aggregator", "common"}}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


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


def folder_of(path: pathlib.Path) -> str | None:
    """A C file's folder as MAY_INCLUDE names it, or None outside them."""
    if path.is_relative_to(NATIVE_TESTS):
        return "tests/native"
    if path.is_relative_to(NATIVE) and len(path.relative_to(NATIVE).parts) == 2:
        folder = path.relative_to(NATIVE).parts[0]
        return folder if folder in MAY_INCLUDE else None
    return None


def c_includes() -> list[tuple[pathlib.Path, str, pathlib.Path | None]]:
    """(file, include as written, the file the builders find for it, None if none) for every
    include of a core file in the native core and its tests: "..." beside the including file,
    then from overcast/native (every builder's -I), <...> from overcast/native only (else it is
    the system's, not listed)."""
    found = []
    for path in sorted([*NATIVE.rglob("*.[ch]"), *NATIVE_TESTS.glob("*.[ch]")]):
        for quote, name in INCLUDE.findall(path.read_text()):
            places = [path.parent / name, NATIVE / name] if quote == '"' else [NATIVE / name]
            target = next((p.resolve() for p in places if p.is_file()), None)
            if target is not None or quote == '"':
                found.append((path, name, target))
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


def test_the_native_cores_files_are_in_its_folders_and_every_builders_list():
    """Each C file in binding/, rank/, aggregator/ or common/; parts.txt (what every builder
    compiles besides the binding) names each of rank's, aggregator's and common's."""
    outside = sorted(str(p.relative_to(ROOT)) for p in NATIVE.rglob("*.[ch]")
                     if folder_of(p) is None)
    assert outside == []
    parts = sorted((NATIVE / "parts.txt").read_text().split())
    assert parts == sorted(str(p.relative_to(NATIVE).with_suffix("")) for p in NATIVE.rglob("*.c")
                           if folder_of(p) != "binding")


def test_native_includes_point_down_its_folders_only():
    """Includes as the compilers resolve them, so that neither a path through ../ nor a header
    reached by another folder's name slips by."""
    wrong = []
    for path, name, target in c_includes():
        where = str(path.relative_to(ROOT))
        if target is None:
            wrong.append(f"{where}: {name} is no file of the core")
        elif folder_of(target) not in MAY_INCLUDE[folder_of(path)]:
            wrong.append(f"{where} includes {target.relative_to(ROOT)}")
    assert wrong == []
