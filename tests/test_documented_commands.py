"""Every fineslab command the README and docs show, parsed by the program's own parser (#39: a
documented command that crashed or took a flag its program lacks reached users first).

Commands are read from the Markdown itself: each line of a fenced block that starts with
`python -m fineslab...` or `fineslab <subcommand>` (with or without `.venv/bin/`), and each inline
`code` span of that form with an option in it; `;`, `&&`, `|` and `>` end a command. A template
(`[--quick]`, `{a,b}`, `<name>`, `...`, or an upper-case placeholder such as `MODEL` or `N`) is
not a command to copy, and is skipped. Each command runs the module's `main` up to its
`ArgumentParser.parse_args`, which is stopped there: nothing else runs. (Running each one in
its quick form is left to the tests of each feature; this one costs about 10 s.)"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from fineslab.cli import SUBCOMMANDS

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
START = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?(?:python3? -m fineslab\b[\w.]*|fineslab (?:"
                   + "|".join(SUBCOMMANDS) + r")\b)")
TEMPLATE = re.compile(r"[\[\]{}<>]|\.\.\.|(?:^|[\s=:])[A-Z][A-Z_]*(?=$|[\s,])")
#: Commands whose parser is another program's (SGLang's, in a child process): run for real
#: by their own tests (tests/serving/test_router_sglang.py runs bench_serving's).
NOT_PARSED_HERE = {"fineslab.bench.bench_serving"}


def documented_commands() -> Iterator[tuple[str, str]]:
    """(where, command) for each command shown."""
    for path in DOCS:
        text, where = path.read_text(), str(path.relative_to(REPO))
        lines = []
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            lines += re.sub(r"\\\n\s*", " ", block).splitlines()
        outside = re.sub(r"```.*?```", "", text, flags=re.S)
        lines += [span for span in re.findall(r"`([^`\n]+)`", outside) if " --" in span]
        for line in lines:
            for part in re.split(r";|&&|\||>", line.split(" #")[0]):
                command = part.strip()
                if START.match(command) and not TEMPLATE.search(command):
                    yield where, command


class _Parsed(Exception):
    """Raised where the command's parser has accepted it."""


def _module_and_args(command: str) -> tuple[str, list[str]]:
    words = shlex.split(command.removeprefix("$ "))
    words[0] = words[0].removeprefix(".venv/bin/")
    if words[0] == "fineslab" or words[2] == "fineslab":
        args = words[1:] if words[0] == "fineslab" else words[3:]
        if args[0] == "bench":
            return f"fineslab.bench.{args[1]}", args[2:]
        return SUBCOMMANDS[args[0]][0], args[1:]
    module = words[2]
    if (REPO / Path(*module.split("."))).is_dir():
        module += ".__main__"
    return module, words[3:]


def parse_problem(command: str, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None if the command's own parser accepts it, else what it said."""
    module_name, args = _module_and_args(command)
    if module_name in NOT_PARSED_HERE:
        return None
    real_parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> NoReturn:
        real_parse(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module(module_name).main(args)
    except _Parsed:
        return None
    except SystemExit as exc:
        return f"exit {exc.code}: {said.getvalue().strip()[-300:]}"
    finally:
        monkeypatch.undo()
    return "its main returned without parsing its arguments"


def test_the_docs_show_commands_of_each_kind() -> None:
    commands = [c for _, c in documented_commands()]
    assert len(commands) > 40
    assert any(c.startswith(".venv/bin/fineslab launch") for c in commands)
    assert any(c.startswith("python -m fineslab.sim") for c in commands)
    assert any(c.startswith("python -m fineslab.bench.") for c in commands)


def test_a_wrong_flag_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = parse_problem("python -m fineslab.bench.placer --no-such-flag", monkeypatch)
    assert problem is not None and "--no-such-flag" in problem
    assert parse_problem("fineslab ctl limit", monkeypatch) is not None
    assert parse_problem("fineslab ctl list", monkeypatch) is None


@pytest.mark.parametrize(("where", "command"), sorted(set(documented_commands())))
def test_each_documented_command_parses(where: str, command: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    problem = parse_problem(command, monkeypatch)
    assert problem is None, f"{where}: `{command}`: {problem}"
