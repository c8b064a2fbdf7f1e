"""The stock-output cache the identity tests compare against: computed once, read back from
disk in a later session, recomputed when the model's files change, never shared across keys."""

from __future__ import annotations

from pathlib import Path

from plugin_test_support import StockOutputs, model_checksum

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
