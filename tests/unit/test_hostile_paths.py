"""Hostile input on a shared cluster: another user plants a symlink or a directory where the job writes.

Each test plants what an attacker with write access to a shared place (``/tmp``, a group-writable run
or submit directory) could plant at a name the job uses, then runs the job's own writer, and checks
that nothing outside the job's files was written, or that the writer refused with one line naming the
path. The tests use the writers' public entry points only, so they run against any version of them.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

from reflow_hpc.config import StorageConfig

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a directory owned by another uid can only be made as root")
PRECIOUS = "someone else's file\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file the job must never write: the target of every planted symlink."""
    p = tmp_path / "victim.txt"
    p.write_text(PRECIOUS)
    return p


def refused(err: pytest.ExceptionInfo, path: Path) -> None:
    text = str(err.value)
    assert type(err.value).__name__ == "UnsafePathError", repr(err.value)
    assert "\n" not in text and str(path) in text, text


# -- the checkpoint's `latest` pointer ------------------------------------------------------------


class _Model:
    def save_pretrained(self, directory, safe_serialization=True):
        os.makedirs(directory, exist_ok=True)
        Path(directory, "model.safetensors").write_bytes(b"weights")


def test_checkpoint_pointer_never_writes_through_a_planted_symlink(tmp_path, victim):
    from reflow_hpc.train.checkpoint import latest_checkpoint, save_checkpoint

    root = tmp_path / "checkpoints"
    root.mkdir(mode=0o700)
    # The pointer's temp file had a predictable name (pid); the pointer itself a fixed one.
    os.symlink(victim, root / f".latest.tmp-{os.getpid()}")
    other = tmp_path / "victim2.txt"
    other.write_text(PRECIOUS)
    os.symlink(other, root / "latest")
    final = save_checkpoint(root, 1, model=_Model(), trainer_state={}, fsync=False)
    assert victim.read_text() == PRECIOUS and other.read_text() == PRECIOUS
    assert not (root / "latest").is_symlink() and (root / "latest").read_text() == "step_000001\n"
    assert latest_checkpoint(root) == final


def test_checkpoint_root_writable_by_others_is_refused(tmp_path):
    from reflow_hpc.train.checkpoint import save_checkpoint

    root = tmp_path / "checkpoints"
    root.mkdir()
    root.chmod(0o777)       # anyone could swap `latest` or a step directory under us
    with pytest.raises(Exception) as err:
        save_checkpoint(root, 1, model=_Model(), trainer_state={}, fsync=False)
    refused(err, root)


def test_checkpoint_partials_never_write_through_a_planted_symlink(tmp_path, victim):
    from reflow_hpc.storage.partials import load_partials, save_partials

    staged = tmp_path / ".step_000001.partials"
    staged.mkdir(mode=0o700)
    os.symlink(victim, staged / "rank0.npz.tmp")
    save_partials(staged / "rank0.npz", [])
    assert victim.read_text() == PRECIOUS and load_partials(staged) == {}


# -- the shard manifest and segments --------------------------------------------------------------


def test_manifest_never_writes_through_a_planted_symlink(tmp_path, victim):
    from reflow_hpc.storage.manifest import Manifest, read_manifest, write_manifest

    shards = tmp_path / "shards"
    shards.mkdir(mode=0o700)
    os.symlink(victim, shards / "manifest.json.tmp")
    other = tmp_path / "victim2.txt"
    other.write_text(PRECIOUS)
    os.symlink(other, shards / "manifest.json")
    write_manifest(shards, Manifest(owner=3), fsync=True)
    assert victim.read_text() == PRECIOUS and other.read_text() == PRECIOUS
    assert not (shards / "manifest.json").is_symlink() and read_manifest(shards).owner == 3


def _trajectory(sid: int):
    from reflow_hpc.trajectory import Trajectory

    return Trajectory(sid, 0, 0, np.arange(6), np.zeros(6), np.full(6, 0), prompt_len=2, finish_reason="stop")


def test_shard_segment_never_created_through_a_planted_symlink(tmp_path, victim):
    from reflow_hpc.storage.schema import segment_name
    from reflow_hpc.storage.writer import NEW_SUFFIX, ShardWriter

    shards = tmp_path / "shards"
    shards.mkdir(mode=0o700)
    # The segment is built under "<name>.open.new", a name anyone can compute.
    os.symlink(victim, shards / (segment_name(0, 0, open_=True) + NEW_SUFFIX))
    w = ShardWriter(shards, 0, StorageConfig())
    w.append([_trajectory(1)])
    w.flush()
    w.close()
    assert victim.read_text() == PRECIOUS
    assert (shards / segment_name(0, 0)).is_file() and not (shards / segment_name(0, 0)).is_symlink()


def test_shard_directory_writable_by_others_is_refused(tmp_path):
    from reflow_hpc.storage.store import SampleStore

    shards = tmp_path / "shards"
    shards.mkdir()
    shards.chmod(0o777)
    with pytest.raises(Exception) as err:
        SampleStore(shards, 0, StorageConfig())
    refused(err, shards)


# -- metrics and the run directory ----------------------------------------------------------------


@pytest.mark.parametrize("append", [False, True])
def test_metrics_never_write_through_a_planted_symlink(tmp_path, victim, append):
    from reflow_hpc.metrics import MetricsSink

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.symlink(victim, run / "metrics.jsonl")
    try:
        sink = MetricsSink(run, append=append)
    except Exception as e:                  # refusing is fine too, with one line naming the file
        assert type(e).__name__ == "UnsafePathError" and str(run / "metrics.jsonl") in str(e)
    else:
        sink.write({"step": 1})
        sink.close()
    assert victim.read_text() == PRECIOUS


def test_run_directory_writable_by_others_is_refused(tmp_path):
    from reflow_hpc.metrics import MetricsSink

    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(Exception) as err:
        MetricsSink(run)
    refused(err, run)


# -- node-local scratch ---------------------------------------------------------------------------


def _scratch(monkeypatch, root: Path) -> Path:
    from reflow_hpc.runtime.topology import scratch_dir

    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return scratch_dir("", "hostile", 0)


def _planted_name(monkeypatch, tmp_path) -> str:
    """The top directory the job uses under the scratch root: as predictable to others as to us."""
    probe = tmp_path / "probe"
    probe.mkdir()
    return _scratch(monkeypatch, probe).relative_to(probe).parts[0]


def _outside(path: Path, planted: Path) -> bool:
    """``path`` is not inside ``planted`` (resolved, so a symlink does not hide it)."""
    return not str(path.resolve()).startswith(str(planted.resolve()) + os.sep)


def test_scratch_planted_as_a_symlink_is_not_used(tmp_path, monkeypatch):
    name = _planted_name(monkeypatch, tmp_path)
    root, trap = tmp_path / "tmp", tmp_path / "attacker"
    root.mkdir()
    trap.mkdir(mode=0o777)
    os.symlink(trap, root / name)            # the attacker would read every shard written there
    scratch = _scratch(monkeypatch, root)
    assert _outside(scratch, trap) and os.listdir(trap) == []
    assert os.lstat(scratch).st_uid == os.geteuid() and not os.lstat(scratch).st_mode & 0o077
    assert _scratch(monkeypatch, root) == scratch          # the same after a requeue


@as_root
def test_scratch_planted_by_another_user_is_not_used(tmp_path, monkeypatch):
    name = _planted_name(monkeypatch, tmp_path)
    root = tmp_path / "tmp"
    root.mkdir()
    (root / name).mkdir(mode=0o777)
    os.chown(root / name, NOBODY, NOBODY)
    scratch = _scratch(monkeypatch, root)
    assert _outside(scratch, root / name) and os.listdir(root / name) == []
    assert _scratch(monkeypatch, root) == scratch


# -- the resume copy of a rank's shards -----------------------------------------------------------


def _resume_copy():
    """The statement the worker runs to copy ``collected`` (run_dir/shards/rankNNNNN) into node-local
    ``trajectory_dir`` when resumed on another node, executed as written in runtime/worker.py."""
    import reflow_hpc.runtime.worker as worker

    tree = ast.parse(Path(worker.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "collected.is_dir()" in ast.unparse(node.test):
            copy = next(s for s in node.body if "collected" in ast.unparse(s))
            src, dst = (a.id for a in copy.value.args[:2])     # the worker's own names for the two paths
            code = compile(ast.Module([copy], []), worker.__file__, "exec")

            def run(collected: Path, trajectory_dir: Path) -> None:
                exec(code, dict(vars(worker)), {src: collected, dst: trajectory_dir})
            return run
    raise AssertionError("runtime/worker.py: the resume copy of collected shards was not found")


def test_resume_copy_refuses_a_symlink_inside_the_collected_shards(tmp_path, victim):
    collected = tmp_path / "run" / "shards" / "rank00000"
    collected.mkdir(parents=True)
    (collected / "seg-r00000-000000.h5").write_bytes(b"rows")
    os.symlink(victim, collected / "seg-r00000-000001.h5")      # would pull someone's file into the store
    dest = tmp_path / "scratch" / "shards"
    with pytest.raises(Exception) as err:
        _resume_copy()(collected, dest)
    refused(err, collected / "seg-r00000-000001.h5")
    copied = [p.read_text() for p in dest.rglob("*") if p.is_file()] if dest.exists() else []
    assert PRECIOUS not in copied


def test_resume_copy_refuses_a_destination_planted_as_a_symlink(tmp_path):
    collected = tmp_path / "run" / "shards" / "rank00000"
    collected.mkdir(parents=True)
    (collected / "seg-r00000-000000.h5").write_bytes(b"rows")
    trap = tmp_path / "attacker"
    trap.mkdir(mode=0o777)
    (tmp_path / "scratch").mkdir()
    dest = tmp_path / "scratch" / "shards"
    os.symlink(trap, dest)                  # empty, so the worker takes it for empty scratch
    with pytest.raises(Exception) as err:
        _resume_copy()(collected, dest)
    refused(err, dest)
    assert os.listdir(trap) == []
