"""`python -m fineslab.bench.bench_serving`: the child command and environment it gives
SGLang's client, and the ShareGPT-format file it ships (the run against a live router is in
test_router_sglang.py). Fast: no SGLang process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fineslab import cpu_mode
from fineslab.bench import bench_serving, sharegpt_mini
from fineslab.bench.sharegpt_mini import DATASET_FILE

SHIPPED = ["--dataset-path", str(DATASET_FILE)]


@pytest.mark.parametrize(("argv", "added"), [
    ([], SHIPPED),  # SGLang's default dataset is sharegpt
    (["--dataset-name", "sharegpt"], SHIPPED),
    (["--dataset-name=random", "--random-input-len", "32"], SHIPPED),
    (["--dataset-name", "random", "--dataset-path", ""], SHIPPED),
    (["--dataset-name", "random-ids"], []),
    (["--dataset-name", "random", "--dataset-path", "/data/sharegpt.json"], []),
])
def test_client_gets_the_shipped_dataset_only_where_sglang_would_download(
        argv: list[str], added: list[str]) -> None:
    assert bench_serving.client_argv(argv, python="py") == [
        "py", "-m", bench_serving.SGLANG_CLIENT, *added, *argv]


def test_an_abbreviated_dataset_path_of_the_caller_still_wins() -> None:
    argv = ["--dataset-name", "random", "--dataset-p", "mine.json"]
    command = bench_serving.client_argv(argv, python="py")
    assert command[-2:] == ["--dataset-p", "mine.json"], "the client reads the caller's last"


def test_cpu_mode_child_gets_the_stubs_and_the_cpu_engine_and_stays_offline() -> None:
    env = bench_serving.client_environ({"FINESLAB_CPU_MODE": "1", "PYTHONPATH": "/mine"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(cpu_mode.STUBS_DIR), "/mine"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"


def test_gpu_mode_child_gets_no_stubs_but_stays_offline() -> None:
    env = bench_serving.client_environ({"FINESLAB_CPU_MODE": "0", "HF_HUB_OFFLINE": "0"})
    assert "PYTHONPATH" not in env and "SGLANG_USE_CPU_ENGINE" not in env
    assert env["HF_HUB_OFFLINE"] == "1", "offline whatever the caller's environment"


def test_a_hub_name_as_tokenizer_is_refused_before_the_client_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("the client must not start")

    monkeypatch.setattr(bench_serving.subprocess, "run", no_child)
    assert bench_serving.main(["--tokenizer", "meta-llama/Llama-3.1-8B"]) == 2


def test_shipped_dataset_is_what_the_generator_writes() -> None:
    assert DATASET_FILE.read_text() == sharegpt_mini.render(sharegpt_mini.generate()), (
        "regenerate it: python -m fineslab.bench.sharegpt_mini")


def test_shipped_dataset_has_what_sglang_reads() -> None:
    conversations = json.loads(DATASET_FILE.read_text())
    assert len(conversations) == sharegpt_mini.NUM_CONVERSATIONS
    for conversation in conversations:
        turns = conversation["conversations"]
        assert [t["from"] for t in turns] == ["human", "gpt"], conversation["id"]
        words = [len(t["value"].split()) for t in turns]
        assert all(sharegpt_mini.MIN_WORDS <= n <= sharegpt_mini.MAX_WORDS for n in words)


def test_generator_writes_the_file_it_is_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "mini.json"
    assert sharegpt_mini.main(["--out", str(out), "--conversations", "3", "--seed", "1"]) == 0
    assert json.loads(out.read_text()) == sharegpt_mini.generate(3, seed=1)
