"""Session-wide fixtures: CPU mode, generated models, and process-leak guards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from start_counting import StartCounter, check_phase

from fineslab import cpu_mode
from fineslab.models.generate import ensure_model

# In CPU mode the stand-ins must be on the path before anything imports sglang, and the
# environment must reach the processes SGLang's Engine spawns.
CPU_MODE = cpu_mode.is_cpu_mode()
if CPU_MODE:
    cpu_mode.activate()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the generated presets `llama-tiny` and `qwen2-tiny` (about 2 s)."""
    cache = tmp_path_factory.mktemp("models")
    for name in ("llama-tiny", "qwen2-tiny"):
        ensure_model(name, cache)
    return cache


# Counted starts: each SGLang runtime, engine and Ray cluster of the run (tests/start_counting.py).
_starts = StartCounter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    check_phase(_starts, item, outcome.get_result())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.section("SGLang and Ray starts")
    for line in _starts.summary_lines():
        terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    _starts.remove()
