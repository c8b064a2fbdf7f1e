"""The runtime contract (fineslab.slabs.contract): written by the launcher, read and checked by the
plugin. The check against a real SGLang build is `plan_differs` in
tests/sglang_plugin/test_plugin_config.py; every launched fleet in the suite joins through one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fineslab.env import FineslabEnv
from fineslab.errors import ConfigError
from fineslab.sglang_plugin import ArenaJoin
from fineslab.slabs.contract import CONTRACT_VERSION, PlannedBlock, RuntimeContract
from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape

LLAMA = KVShape("m", 4, 2, 64, KVDtype.BF16)


def _join() -> ArenaJoin:
    return ArenaJoin("fleet-a", "m-r0", key_pool=True, weights_in_arena=True,
                     layer_streaming=True, kv_format=KVDtype.INT4, prefix_lending=0)


def test_a_join_written_as_a_contract_reads_back_as_the_same_join(tmp_path: Path) -> None:
    planned = BlockFormat.unpadded(LLAMA, 16)
    path = _join().contract("cpu", planned, {"stream": "/x"}).write(tmp_path / "c.json")
    doc = json.loads(path.read_text())
    assert doc["version"] == CONTRACT_VERSION and doc["block"]["tokens_per_block"] == 16
    assert doc["files"] == {"stream": "/x"} and doc["kv_format"] == "int4"
    join = ArenaJoin.from_env(FineslabEnv.from_environ({"FINESLAB_CONTRACT": str(path)}))
    assert join is not None
    assert join == ArenaJoin("fleet-a", "m-r0", True, True, True, KVDtype.INT4, None, 0,
                             PlannedBlock.of(planned), str(path))


def test_the_contract_is_the_join_and_the_markers_must_agree(tmp_path: Path) -> None:
    path = _join().contract("cpu", None).write(tmp_path / "c.json")
    env = {"FINESLAB_CONTRACT": str(path), "FINESLAB_ARENA": "fleet-a",
           "FINESLAB_RUNTIME_ID": "m-r0", "FINESLAB_KEY_POOL": "0"}
    join = ArenaJoin.from_env(FineslabEnv.from_environ(env))
    assert join is not None and join.key_pool, "the contract, not the separate variable"
    with pytest.raises(ConfigError, match="FINESLAB_RUNTIME_ID='other' but the runtime contract"):
        ArenaJoin.from_env(FineslabEnv.from_environ({**env, "FINESLAB_RUNTIME_ID": "other"}))


@pytest.mark.parametrize(("doc", "expected"), [
    ("not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"version": 0, "arena": "a", "runtime_id": "r", "device": "cpu"}', "version 0"),
    ('{"version": 1, "arena": "a", "runtime_id": "r", "device": "cpu", "extra": 1}',
     "unknown fields ['extra']"),
    ('{"version": 1, "arena": "", "runtime_id": "r", "device": "cpu"}', "arena must be"),
    ('{"version": 1, "runtime_id": "r", "device": "cpu"}', "arena"),
    ('{"version": 1, "arena": "a", "runtime_id": "r", "device": "cpu", "block": {"x": 1}}',
     "unexpected keyword"),
])
def test_a_bad_contract_is_refused_naming_the_file_and_the_fault(tmp_path: Path, doc: str,
                                                                 expected: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(doc)
    with pytest.raises(ConfigError, match="runtime contract") as err:
        RuntimeContract.read(path)
    assert expected in str(err.value) and str(path) in str(err.value)


def test_a_missing_contract_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        ArenaJoin.from_env(FineslabEnv.from_environ({"FINESLAB_CONTRACT": "/no/such.json"}))


def test_a_built_block_other_than_the_plan_fails_with_both_shapes() -> None:
    planned = BlockFormat.unpadded(LLAMA, 16)
    contract = _join().contract("cpu", planned)
    contract.check_block(planned)  # the same block passes
    other = BlockFormat(KVShape("m", 4, 2, 64, KVDtype.FP16), 32, 2048)
    with pytest.raises(ConfigError) as err:
        contract.check_block(other)
    message = str(err.value)
    assert "SGLang built a KV block of 4 layers x 2 KV heads x 64 dims in float16, 32-token" \
        in message
    assert "but the plan is 4 layers x 2 KV heads x 64 dims in bfloat16, 16-token" in message
    RuntimeContract("a", "r", "cpu").check_block(other)  # nothing planned: nothing checked
