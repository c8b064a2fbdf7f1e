"""The stock-output cache the identity tests compare against: computed once, read back from
disk in a later session, recomputed when the model's files change, never shared across keys;
and the stock servers kept between its computations."""

from __future__ import annotations

from pathlib import Path

from plugin_test_support import StockOutputs, StockServers, model_checksum

from fineslab.models.generate import ensure_model

IDS = ((11, 12, 13), (14, 15))


class FakeEngine:
    """Stands in for the in-process engine (what is cached, not how it is computed)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model_dir: Path, jobs: list[tuple[list[list[int]], int]],
                 **_: object) -> list[list[list[int]]]:
        self.calls += 1
        return [[[len(p), n, len(model_dir.name)] for p in prompts] for prompts, n in jobs]


def test_a_later_session_reads_what_an_earlier_one_computed(tmp_path: Path,
                                                           model_cache: Path) -> None:
    first, second = FakeEngine(), FakeEngine()
    out = StockOutputs(model_cache, tmp_path, first)("llama-tiny", 16, "bfloat16", IDS, 4)
    again = StockOutputs(model_cache, tmp_path, second)("llama-tiny", 16, "bfloat16", IDS, 4)
    assert first.calls == 1 and second.calls == 0 and again == out
    StockOutputs(model_cache, tmp_path, second)("llama-tiny", 32, "bfloat16", IDS, 4)
    assert second.calls == 1, "another page size is another key"
    StockOutputs(model_cache, None, second)("llama-tiny", 16, "bfloat16", IDS, 4)
    assert second.calls == 2, "no folder: nothing is read from disk"


def test_the_key_follows_the_models_files(tmp_path: Path) -> None:
    a = ensure_model("llama-tiny", tmp_path / "a")
    b = ensure_model("llama-tiny", tmp_path / "b")
    assert model_checksum(a) == model_checksum(b), "generated models are the same bytes"
    (b / "config.json").write_text((b / "config.json").read_text() + " ")
    assert model_checksum(a) != model_checksum(b)


class FakeServer:
    def __init__(self, settings: tuple[Path, int, str]) -> None:
        self.settings, self.stopped, self.intact = settings, False, True

    def tree_intact(self) -> bool:
        return self.intact

    def stop(self) -> None:
        self.stopped = True


def test_stock_servers_are_kept_per_settings_the_least_recently_used_stopped() -> None:
    started: list[FakeServer] = []

    def start(model: Path, page: int, dtype: str) -> FakeServer:
        started.append(FakeServer((model, page, dtype)))
        return started[-1]

    servers = StockServers(keep=2, start=start)  # type: ignore[arg-type]
    a = servers.server_for(Path("m"), 16, "bfloat16")
    b = servers.server_for(Path("m"), 1, "bfloat16")
    assert servers.server_for(Path("m"), 16, "bfloat16") is a and len(started) == 2, "kept"
    c = servers.server_for(Path("q"), 16, "float16")  # a third: b, the least recently used, goes
    assert b.stopped and not a.stopped and not c.stopped and len(started) == 3
    a.intact = False  # a process of its tree died: replaced, not reused
    again = servers.server_for(Path("m"), 16, "bfloat16")
    assert again is not a and a.stopped and len(started) == 4
    servers.close()
    assert all(s.stopped for s in started) and not servers.servers
