"""The commands the README and the docs show, as written: every `overcast` command parses with the
command's own flags (placeholders such as FILE or HOST given a value), every torchrun command with
torchrun's, and those that need neither root, a GPU nor other machines run to their end (an
aggregator until it says where it listens). Benchmark records in results.md are parsed, not
rerun."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from overcast.cli.main import ALIASES, parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# What a placeholder in a documented command stands for, to parse or run it.
PLACEHOLDERS = {"FILE": "out.json", "PREFIX": "timeline", "RUNS": "run.json", "HOST": "127.0.0.1",
                "P": "4", "B": "100", "R": "400", "$way": "overcast", "$SECRET": "ab" * 32,
                "<hex>": "ab" * 32, "<the same 64 hex digits everywhere>": "ab" * 32}
# The commands run as written: those that need no root, GPU or second machine, and end soon.
RUN = ("overcast plan", "overcast aggregator", "overcast simulate --hosts 8,64,188,1024 --topology "
       "fat-tree --radix 32 --link-gbit 100 --sizes 64MiB --collectives overlap")

def commands() -> list[tuple[str, str, tuple[str, ...]]]:
    """(document, command, the `export`s before it in its block) for each shell command in a code
    block of the documents: indented blocks whose line starts with a command this project ships
    or uses, continued over lines ending in a backslash, trailing comments dropped."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        fenced, exports, i = False, [], 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                fenced = not fenced
            elif not line.startswith("    "):
                exports = []  # a block ends
            elif not fenced and line.startswith("    export "):
                exports.append(line.strip())
            elif not fenced and re.match(r"    (\w+=\S+ )*(overcast|torchrun|srun) ", line):
                command = line[4:]
                while command.endswith("\\"):
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                found.append((doc.name, re.sub(r"\s+#.*$", "", command).strip(),
                              tuple(exports)))
            i += 1
    return found


def filled(command: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        command = re.sub(rf"(?<![\w$<-]){re.escape(placeholder)}(?![\w>])", value, command)
    return command


def split(command: str) -> tuple[dict, list[str]]:
    """(the VAR=value settings before the command, the command's words)."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^\w+=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


COMMANDS = commands()


def test_the_documents_show_commands_of_every_kind():
    shown = {words[0] + (" " + words[1] if words[0] == "overcast" else "")
             for _, c, _ in COMMANDS for words in [split(filled(c))[1]]}
    assert {"overcast plan", "overcast simulate", "overcast aggregator",
            "overcast bench", "overcast train", "overcast cluster", "torchrun", "srun"} <= shown


@pytest.mark.parametrize("doc,command", [c[:2] for c in COMMANDS],
                         ids=[f"{d}:{c[:60]}" for d, c, _ in COMMANDS])
def test_each_command_parses_as_written(doc, command):
    _, words = split(filled(command))
    if words[0] == "srun":
        words = words[1:]
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser
        args = get_args_parser().parse_args(words[1:])
        script = [args.training_script, *args.training_script_args]
        if args.no_python:
            words = script
        else:
            assert script[0] == "train.py" or (ROOT / script[0]).exists(), script
            return
    assert words[0] == "overcast", words
    argv = words[1:]
    command_words = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    assert not any(a in ALIASES for a in argv), f"{doc} shows an old flag name: {command}"
    parser().parse_args(argv)  # argparse exits (a failure here) on a flag it does not know
    if command_words[:1] == ["overcast"]:
        parser().parse_args(command_words[1:])


def _run(command: str, exports: tuple[str, ...], cwd: pathlib.Path):
    """The command in bash after its block's exports, `overcast` the one beside this Python,
    nothing of overcast's in the environment but what the document sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERCAST_")}
    env.update(PATH=f"{pathlib.Path(sys.executable).parent}:{env['PATH']}", OMP_NUM_THREADS="1")
    settings, words = split(filled(command))
    line = "exec " + ("env " if settings else "") + filled(command)
    script = "; ".join([*(filled(e) for e in exports), line])
    if words[:2] == ["overcast", "aggregator"]:  # it serves until stopped: until it says where
        with subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) as proc:
            said = proc.stdout.readline()
            proc.terminate()
            _, err = proc.communicate(timeout=30)
        return subprocess.CompletedProcess(script, 0 if "listening on" in said else 1, said, err)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


RUNNABLE = [(d, c, e) for d, c, e in COMMANDS if d != "results.md" and
            " ".join(split(filled(c))[1]).startswith(RUN)]

@pytest.mark.parametrize("doc,command,exports", RUNNABLE,
                         ids=[f"{d}:{c[:60]}" for d, c, _ in RUNNABLE])
def test_each_command_that_needs_no_root_runs_as_written(doc, command, exports, tmp_path):
    profile = tmp_path / "out" / "train" / "profile-default.json"  # what tools/demo writes
    profile.parent.mkdir(parents=True)
    profile.write_text(json.dumps({"what": "overcast train, way gloo, 4 hosts at 100 Mbit/s",
                                   "step_seconds": 3.3, "exposed_seconds": 3.1,
                                   "compute_seconds": 0.2}))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    done = _run(command, exports, tmp_path)
    assert done.returncode == 0, f"{doc}: {command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def test_the_readme_inline_loopback_command_sets_what_it_needs():
    """The README's torchrun line, as written, gives loopback the link rate multicast needs
    (the script raises without it: tests/test_train.py runs it)."""
    text = (ROOT / "README.md").read_text()
    shown = re.findall(r"`([^`]*torchrun[^`]*)`", text)
    assert shown and all("OVERCAST_LINK_BITS_PER_S=" in c for c in shown), shown


def test_the_aggregator_says_it_needs_the_secret():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERCAST_")}
    done = subprocess.run([sys.executable, "-m", "overcast.cli.main", "aggregator", "--help"],
                          capture_output=True, text=True, env=env)
    assert "OVERCAST_SECRET" in done.stdout
    done = subprocess.run([sys.executable, "-m", "overcast.cli.main", "aggregator"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "set OVERCAST_SECRET" in done.stderr
