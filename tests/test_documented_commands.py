"""Every fineslab command the README and docs show: parsed by the program's own parser, and
run in its quick form by a test that tests/documented_commands.toml names (#39: a documented
command that crashed or took a flag its program lacks reached users first).

Commands are read from the Markdown itself: each line of a fenced block that starts with
`python -m fineslab...` or `fineslab <subcommand>` (with or without `.venv/bin/`), and each inline
`code` span of that form with an option in it; `;`, `&&`, `|` and `>` end a command. A template
(`[--quick]`, `{a,b}`, `<name>`, `...`, or an upper-case placeholder such as `MODEL` or `N`) is
not a command to copy, and is skipped. Each command runs the module's `main` up to its
`ArgumentParser.parse_args`, which is stopped there: nothing else runs (about 10 s).

Running each one is the table's work. A command's *program key* is
    - the program's dotted name: `python -m fineslab.bench.wake` and `fineslab bench wake` are
      `fineslab.bench.wake`; `fineslab X` and `python -m fineslab X` are `fineslab.X`;
    - plus, for a program with subcommands (its module calls `add_subparsers`), the first word
      that is neither an option nor the word right after one: `fineslab.sim fig10`,
      `fineslab.ctl sleep` (of `fineslab ctl --url URL sleep llama-a`);
    - for the launcher, instead, its `--config` file, and `--dry-run` when given:
      `fineslab.launch examples/cpu-demo.yaml`, `fineslab.launch examples/gpu-cluster.yaml
      --dry-run`.
Each key has one row in the table: `tests` (pytest node ids, a parametrized test by its
function's name) that run the program in a quick form, `how` they run it, `reason` when a
documented form cannot run here (a GPU, a user's Ray cluster, a run of many minutes) and the
tests run the nearest form that can, and `via` when the tests reach the program through a
helper. The tests below read the test files with `ast` (nothing is imported or collected) and
check that each named test exists and that its source (or its `via`'s) names the program: its
dotted name, its `main` as the test file imports it (for a package, anything the file imports
from its modules), or the launcher's config file; and the subcommand, when the key has one.
A `via` of the fineslab package itself is machinery the program runs (for `--ray`,
`ClusterFleet`): the program's module, or one it imports, must name it. (The table is TOML,
read with `tomllib`: Python 3.11 or later.)"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import io
import re
import shlex
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from fineslab.cli import SUBCOMMANDS

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
START = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?(?:python3? -m fineslab\b[\w.]*|fineslab (?:"
                   + "|".join(SUBCOMMANDS) + r")\b)")
TEMPLATE = re.compile(r"[\[\]{}<>]|\.\.\.|(?:^|[\s=:])[A-Z][A-Z_]*(?=$|[\s,])")
TABLE = Path(__file__).with_name("documented_commands.toml")
tomllib = pytest.importorskip("tomllib", reason="the table is read with Python 3.11's tomllib")
ROW_FIELDS = {"tests", "how", "reason", "via"}
#: Commands whose parser is another program's (SGLang's, in a child process): run for real
#: by their own tests (tests/serving/test_demo_fleet.py runs bench_serving's).
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


def _program_and_args(command: str) -> tuple[str, list[str]]:
    """The program's dotted name (`fineslab X` is `fineslab.X`, `fineslab bench X` is
    `fineslab.bench.X`) and the arguments it is given."""
    words = shlex.split(command.removeprefix("$ "))
    words[0] = words[0].removeprefix(".venv/bin/")
    if words[0] == "fineslab" or words[2] == "fineslab":
        args = words[1:] if words[0] == "fineslab" else words[3:]
        if args[0] == "bench":
            return f"fineslab.bench.{args[1]}", args[2:]
        return f"fineslab.{args[0]}", args[1:]
    return words[2], words[3:]


def _module_and_args(command: str) -> tuple[str, list[str]]:
    program, args = _program_and_args(command)
    subcommand = program.removeprefix("fineslab.")
    if subcommand in SUBCOMMANDS and subcommand != "bench":
        return SUBCOMMANDS[subcommand][0], args
    if _module_file(program).name == "__main__.py":
        program += ".__main__"
    return program, args


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


def _module_file(program: str) -> Path:
    """The file `python -m program` runs."""
    path = REPO / Path(*program.split("."))
    return path / "__main__.py" if path.is_dir() else path.with_suffix(".py")


def _first_positional(args: list[str]) -> str | None:
    after_option = False
    for word in args:
        if word.startswith("-"):
            after_option = True
        elif after_option:
            after_option = False
        else:
            return word
    return None


def program_key(command: str) -> str:
    """The command's row in the table (the rule is the module docstring's)."""
    program, args = _program_and_args(command)
    if program == "fineslab.launch":
        config = args[args.index("--config") + 1] if "--config" in args else "?"
        return " ".join([program, config, *(["--dry-run"] if "--dry-run" in args else [])])
    path = _module_file(program)
    if path.is_file() and "add_subparsers" in path.read_text():
        return f"{program} {_first_positional(args)}"
    return program


def load_table(path: Path = TABLE) -> dict[str, dict[str, Any]]:
    with path.open("rb") as file:
        return tomllib.load(file)


def missing_rows(commands: Iterable[tuple[str, str]], table: dict[str, Any]) -> list[str]:
    """One line per documented command whose program key has no row."""
    return [f"{where}: `{command}` runs {program_key(command)!r}, which has no row in "
            f"{TABLE.relative_to(REPO)}"
            for where, command in sorted(set(commands)) if program_key(command) not in table]


def stale_rows(commands: Iterable[tuple[str, str]], table: dict[str, Any]) -> list[str]:
    """One line per row that no documented command runs."""
    documented = {program_key(command) for _, command in commands}
    return [f"{TABLE.relative_to(REPO)}: row {key!r} is no documented command's program: "
            "remove it, or correct its key" for key in table if key not in documented]


@functools.cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    source = path.read_text()
    return source, ast.parse(source, str(path))


def _definition(path: Path, names: list[str]) -> str | None:
    """The source of the function or class `names` (a class's method: [class, method]) at the
    top level of `path`, its decorators included, or None."""
    source, tree = _parsed(path)
    body: list[ast.stmt] = tree.body
    found: ast.stmt | None = None
    for name in names:
        found = next((node for node in body if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name),
            None)
        if found is None:
            return None
        body = found.body
    if found is None:
        return None
    first = min([found.lineno, *(d.lineno for d in getattr(found, "decorator_list", []))])
    return "\n".join(source.splitlines()[first - 1:found.end_lineno])


def _find_definition(name: str, first: Path) -> tuple[Path, str] | None:
    """Where `name` is defined: `first`, then another file of tests/, then of fineslab/."""
    for path in (first, *sorted(REPO.glob("tests/**/*.py")),
                 *sorted(REPO.glob("fineslab/**/*.py"))):
        if (found := _definition(path, [name])) is not None:
            return path, found
    return None


def _imported_files(path: Path) -> Iterator[Path]:
    """The fineslab modules `path` imports from (`from X import Y`: X, and X.Y when a module)."""
    for node in ast.walk(_parsed(path)[1]):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fineslab"):
            base = REPO / Path(*str(node.module).split("."))
            yield base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            yield from (base / f"{alias.name}.py" for alias in node.names)


def _names(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def _needles(key: str, test_file: Path) -> set[str]:
    """What a test that runs the key's program says: the launcher's config file name, else the
    program's dotted name (`bench.wake` too) or what the test file imports of it: its `main`
    (`wake.main` of an imported module `wake`), or anything of a package's modules (the
    experiment functions `python -m fineslab.sim` runs)."""
    program, *rest = key.split()
    if program == "fineslab.launch" and (REPO / rest[0]).is_file():
        return {Path(rest[0]).name}
    short = program.removeprefix("fineslab.")
    package = (REPO / Path(*program.split("."))).is_dir()
    imported = set()
    parent, _, last = program.rpartition(".")
    for node in ast.walk(_parsed(test_file)[1]):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        inside = node.module == program or node.module.startswith(program + ".")
        for alias in node.names:
            if node.module == parent and alias.name == last:
                imported.add(f"{alias.asname or alias.name}.main")
            elif inside and (package or alias.name == "main"):
                imported.add(alias.asname or alias.name)
    return {program, *([short] if "." in short else []), *imported}


def _test_problem(key: str, node_id: str, via: str | None) -> str | None:
    """None if the test exists and names the key's program (and subcommand), else why not."""
    file, _, names = node_id.partition("::")
    path = REPO / file
    if not names or not file.startswith("tests/") or not path.is_file():
        return "no such test file (a node id is tests/<path>.py::<test function>)"
    text = _definition(path, names.split("::"))
    if text is None:
        return f"{file} defines no {names}"
    program, *rest = key.split()
    runs_it = False
    if via is not None:
        found = _find_definition(via, path)
        if not _names(text, via) or found is None:
            return f"it does not name its via {via!r}, or {via!r} is defined nowhere"
        if found[0].is_relative_to(REPO / "fineslab"):
            program_files = [_module_file(program), *_imported_files(_module_file(program))]
            runs_it = any(_names(f.read_text(), via) for f in program_files if f.is_file())
            if not runs_it:
                return f"{program} neither defines nor imports anything that names {via!r}"
        else:
            text += "\n" + found[1]
    needles = _needles(key, path)
    if not runs_it and not any(_names(text, needle) for needle in needles):
        return f"its source names none of {sorted(needles)}: it does not run {key!r}"
    if rest and program != "fineslab.launch" and not _names(text, rest[0]):
        return f"its source never names the subcommand {rest[0]!r}"
    return None


def row_problems(key: str, row: dict[str, Any]) -> list[str]:
    """What is wrong with the table's row for `key`: nothing, when each test it names exists
    and runs the program."""
    where = f"{TABLE.name} [{key!r}]"
    problems = [f"{where}: unknown field {field!r}" for field in sorted(set(row) - ROW_FIELDS)]
    tests = row.get("tests") if isinstance(row.get("tests"), list) else None
    if not tests:
        problems.append(f"{where}: no tests: name the test that runs the program in its quick "
                        "form (or, with a reason, the test of its nearest form)")
    if not row.get("how"):
        problems.append(f"{where}: no `how`: say in a line how the tests run it")
    for node_id in tests or []:
        if (problem := _test_problem(key, node_id, row.get("via"))) is not None:
            problems.append(f"{where}: {node_id}: {problem}")
    return problems


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


def test_a_program_key_is_the_program_and_its_subcommand_or_config() -> None:
    keys = {
        "fineslab ctl --url http://127.0.0.1:8000 limit llama-a 512M": "fineslab.ctl limit",
        ".venv/bin/fineslab ctl list": "fineslab.ctl list",
        "fineslab sim fig10 --quick": "fineslab.sim fig10",
        "python -m fineslab.sim capacity-parts --quick": "fineslab.sim capacity-parts",
        "python -m fineslab.profile measure --via http": "fineslab.profile measure",
        "python -m fineslab.bench.wake --json": "fineslab.bench.wake",
        "fineslab bench wake --json": "fineslab.bench.wake",
        ".venv/bin/fineslab slabs --fleet cpu-demo --device cpu:0": "fineslab.slabs",
        "python -m fineslab.slabs --table /dev/shm/x.table": "fineslab.slabs",
        "fineslab launch --config examples/cpu-demo.yaml": "fineslab.launch examples/cpu-demo.yaml",
        "python -m fineslab.launch --config examples/gpu-cluster.yaml --dry-run":
            "fineslab.launch examples/gpu-cluster.yaml --dry-run",
    }
    assert {command: program_key(command) for command in keys} == keys


def test_each_documented_program_has_a_row() -> None:
    problems = missing_rows(documented_commands(), load_table())
    assert not problems, "\n".join([*problems, "Add a row naming the test that runs it in its "
                                    "quick form (or the reason it cannot run here, and the "
                                    "test of its nearest form)."])


def test_each_row_is_a_documented_program() -> None:
    problems = stale_rows(documented_commands(), load_table())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("key", sorted(load_table()))
def test_each_row_names_tests_that_run_its_program(key: str) -> None:
    problems = row_problems(key, load_table()[key])
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_program_without_a_row_and_a_made_up_row() -> None:
    table = load_table()
    new = [("docs/new.md", "python -m fineslab.bench.nosuch --json"),
           ("docs/new.md", "fineslab ctl --url http://127.0.0.1:8000 explode llama-a")]
    problems = missing_rows(new, table)
    assert len(problems) == 2, problems
    for problem, key in zip(problems, ("'fineslab.ctl explode'", "'fineslab.bench.nosuch'"),
                            strict=True):
        assert problem.startswith("docs/new.md: `") and key in problem, problem
        assert "tests/documented_commands.toml" in problem, "it names the file to edit"
    assert missing_rows([("README.md", "fineslab bench wake --json")], table) == []
    assert stale_rows(new, {"fineslab.bench.nosuch": {}, "fineslab.bench.gone": {}}) == [
        "tests/documented_commands.toml: row 'fineslab.bench.gone' is no documented command's "
        "program: remove it, or correct its key"]

    placer = "tests/scheduler/test_bench_placer.py::test_bench_placer_json_has_every_placer"
    assert row_problems("fineslab.bench.placer", {"tests": [placer], "how": "its main"}) == []
    made_up = {"tests": [placer], "how": "its main"}
    assert "does not run 'fineslab.bench.wake'" in " ".join(
        row_problems("fineslab.bench.wake", made_up)), "a test of another program"
    gone = {"tests": [placer.replace("json_has", "no_such")], "how": "its main"}
    assert "defines no test_bench_placer_no_such" in " ".join(
        row_problems("fineslab.bench.placer", gone))
    assert "no tests" in " ".join(row_problems("fineslab.bench.placer", {"how": "nothing"}))
    plans = "tests/test_gpu_check_script.py::test_pool_bench_runs_what_device_asks_for"
    assert "does not run 'fineslab.bench.pool'" in " ".join(row_problems(
        "fineslab.bench.pool", {"tests": [plans], "how": "its planning helpers"})), \
        "calling a module's helpers is not running it"
    limit = table["fineslab.ctl limit"]
    assert "never names the subcommand 'explode'" in " ".join(
        row_problems("fineslab.ctl explode", limit)), "the subcommand is checked too"
    assert "its via '_nothing'" in " ".join(
        row_problems("fineslab.ctl limit", dict(limit, via="_nothing")))
