"""Session-wide fixtures: CPU mode, generated models, and process-leak guards."""

from __future__ import annotations

import os

# One compute thread for every process the suite starts, before anything imports torch: two
# test processes share the machine's cores, and torch's default (every core, for each of them
# and each runtime they start) oversubscribed them. The fleets the tests launch get the
# launcher's own default instead (fleet_support.launch), as users do.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator
from pathlib import Path

import pytest
from start_counting import StartCounter, check_phase

from fineslab import cpu_mode
from fineslab.env import SHARED_ZYGOTE_VAR
from fineslab.models.generate import ensure_model
from fineslab.runtime import serve_zygote_to_children
from fineslab.zygote import Zygote

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


class _WorkerStarts:
    """Under pytest-xdist: a worker hands its start counts to the controller as it ends."""

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: object, error: object) -> None:
        counts = getattr(node, "workeroutput", {}).get("fineslab_starts")
        if counts:
            _starts.merge(counts)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with slow tests first, each file's tests in their order. Under `make test`
    xdist then orders the files by their number of tests (this order breaks its ties): keeping
    this order instead (`--no-loadscope-reorder`) put two heavy fleets on the two workers at
    once for the first half of a run, and two tests failed under that load (2026-11-29)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


# The suite's zygote (fineslab.runtime.serve_zygote_to_children): one per test process, from
# which the runtimes of every fleet, node fleet and benchmark it launches fork (each launcher
# imported SGLang for a zygote of its own before: 43 zygotes a run, ~10 CPU-s each). Tests of
# the launcher's own zygote (its supervision, a launcher killed while it imports, its cost)
# ask for `own_zygote`.
_zygote: list[Zygote] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    if getattr(session.config, "workerinput", None) is None \
            and session.config.getoption("numprocesses", None):
        return  # the xdist controller runs no test
    if session.config.option.collectonly:
        return  # nothing runs (scripts/gpu_check.sh --check collects, 30 s with a zygote)
    if any(item.get_closest_marker("slow") is not None for item in session.items):
        zygote = serve_zygote_to_children()
        if zygote is not None:
            _zygote.append(zygote)
        _starts.new_begins("(the suite's zygote)")


@pytest.fixture(scope="module")
def own_zygote() -> Iterator[None]:
    """This module's launchers and runtimes start zygotes of their own, as a user's do."""
    socket = os.environ.pop(SHARED_ZYGOTE_VAR, None)
    yield
    if socket is not None:
        os.environ[SHARED_ZYGOTE_VAR] = socket


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerStarts(), "fineslab-worker-starts")


def pytest_sessionfinish(session: pytest.Session) -> None:
    for zygote in _zygote:
        zygote.stop()
    os.environ.pop(SHARED_ZYGOTE_VAR, None)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["fineslab_starts"] = _starts.to_json()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.section("SGLang and Ray starts")
    for line in _starts.summary_lines():
        terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    _starts.remove()
