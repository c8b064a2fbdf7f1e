"""SlabArena lifecycle: file names and modes, clean unlink, stale files, attach."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from slab_constants import FMT_A, NUM_SLABS, SLAB_BYTES, dead_pid

from fineslab.errors import ConfigError, EnvironmentSetupError
from fineslab.slabs.arena import ArenaSpec, SlabArena
from fineslab.slabs.client import RuntimeSlabs
from fineslab.slabs.shm import ArenaPaths

SPEC = ArenaSpec("life", "cpu0", NUM_SLABS * SLAB_BYTES, SLAB_BYTES, 8)




def test_files_are_private_and_unlinked_on_close(tmp_path: Path) -> None:
    arena = SlabArena.create(SPEC, shm_dir=tmp_path)
    paths = ArenaPaths.of("life", "cpu0", tmp_path)
    for path in (paths.table, paths.data):
        assert path.exists() and (os.stat(path).st_mode & 0o777) == 0o600, f"{path} is 0600"
    arena.close()
    assert not paths.table.exists() and not paths.data.exists(), "clean shutdown unlinks"


def test_attach_sees_the_same_bytes_and_table(tmp_path: Path) -> None:
    with SlabArena.create(SPEC, shm_dir=tmp_path) as owner:
        other = SlabArena.attach("life", "cpu0", shm_dir=tmp_path)
        rt = RuntimeSlabs.attach("life", "cpu0", "r0", FMT_A, shm_dir=tmp_path)
        rt.alloc(3)
        assert int(owner.table.used[0]) == 3, "the owner sees the runtime's blocks"
        mine, theirs = owner.tensor(), other.tensor()
        assert isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
        theirs[123] = 77
        assert int(mine[123]) == 77, "one set of bytes"
        rt.close()
        other.close()
        assert ArenaPaths.of("life", "cpu0", tmp_path).table.exists(), "attachers never unlink"


def test_live_arena_of_the_same_name_is_refused(tmp_path: Path) -> None:
    with SlabArena.create(SPEC, shm_dir=tmp_path), pytest.raises(EnvironmentSetupError):
        SlabArena.create(SPEC, shm_dir=tmp_path)


def test_stale_arena_is_reclaimed_or_refused(tmp_path: Path) -> None:
    crashed = SlabArena.create(SPEC, shm_dir=tmp_path)
    crashed.table.header[6] = dead_pid()  # its creator is gone, files left behind
    with pytest.raises(EnvironmentSetupError, match="stale"):
        SlabArena.create(SPEC, shm_dir=tmp_path, reclaim_stale=False)
    with SlabArena.create(SPEC, shm_dir=tmp_path) as fresh:
        assert fresh.table.creator.pid == os.getpid(), "reclaimed and created afresh"


def test_attach_without_launcher_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentSetupError, match="launcher"):
        SlabArena.attach("nobody", "cpu0", shm_dir=tmp_path)


@pytest.mark.parametrize("fleet", ["", "a/b", "x" * 65])
def test_bad_fleet_ids_are_refused(tmp_path: Path, fleet: str) -> None:
    with pytest.raises(ConfigError):
        SlabArena.create(ArenaSpec(fleet, "cpu0", SLAB_BYTES, SLAB_BYTES, 8), shm_dir=tmp_path)


def test_arena_must_be_whole_slabs() -> None:
    with pytest.raises(ConfigError):
        ArenaSpec("f", "cpu0", SLAB_BYTES * 3 + 1, SLAB_BYTES, 8)
    fitted = ArenaSpec.fit("f", "cpu0", SLAB_BYTES * 3 + 1, SLAB_BYTES, [FMT_A])
    assert fitted.num_slabs == 3 and fitted.max_blocks_per_slab == 8
