"""The fast cases of the fault matrix (`make faults` runs the rest, with real kills): the run-directory lock, a
pickle payload in state.pt, metrics kept one record per update across a resume, torchrun restarts, bad text files.
"""

import json
import pickle
from pathlib import Path

import pytest
import torch

from mtcli import checkpoint as ckpt
from mtcli.errors import MtcliError
from mtcli.metrics import _truncate_records
from mtcli.rundir import RunLock


def test_a_second_trainer_is_refused_by_the_lock_and_a_released_lock_is_free(tmp_path):
    first = RunLock(tmp_path)
    with pytest.raises(MtcliError, match=r"is being trained by process \d+ on .* \(lock file"):
        RunLock(tmp_path)
    first.release()
    RunLock(tmp_path).release()  # the kernel lock is gone with its holder: no stale lock to clean up


def test_a_pickle_payload_in_state_pt_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    folder = tmp_path / "update_00000001"
    folder.mkdir()
    torch.save({"update": 1, "evil": Payload()}, folder / "state.pt", pickle_module=pickle)
    with pytest.raises(MtcliError, match=r"state.pt: refused \(UnpicklingError"):
        ckpt.load_state(folder)
    assert not marker.exists()
    (folder / "state.pt").write_bytes(b"\x80\x04 half a file")
    with pytest.raises(MtcliError, match="state.pt: refused"):
        ckpt.load_state(folder)


def test_records_after_the_checkpoint_are_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"update": u, "loss": 1.0 / u}) + "\n" for u in range(1, 8)]
    path.write_text("".join(records) + '{"update": 8, "lo')  # the kill cut the last line
    _truncate_records(path, 5)
    assert path.read_text() == "".join(records[:5])
    _truncate_records(path, 0)  # a fresh start after a run killed before its first checkpoint
    assert path.read_text() == ""


def test_a_torchrun_restart_resumes_by_itself(tmp_path, monkeypatch):
    from mtcli.rundir import torchrun_restart

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not torchrun_restart(tmp_path)  # nothing to resume from: a fresh start
    (tmp_path / "checkpoints" / "update_00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "update_00000004" / "model.safetensors").write_bytes(b"")
    assert torchrun_restart(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not torchrun_restart(tmp_path)  # the first attempt never resumes on its own


def test_a_training_state_saved_under_the_old_key_name_still_loads(tmp_path):
    """state.pt before 2026-12-06 held the position in the epoch as `group`; a resume of such a run reads it."""
    folder = tmp_path / "update_00000008"
    folder.mkdir()
    keys = ("update", "epoch", "best_score", "bad_validations", "world_size", "optimizer", "scaler", "rng")
    torch.save({**{k: 0 for k in keys}, "group": 5}, folder / "state.pt")
    assert ckpt.load_state(folder)["next_in_epoch"] == 5
