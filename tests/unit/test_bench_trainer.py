"""tools/bench_trainer.py: the samples it reads from a run's collected shards, and the passes it counts."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT
from storage_samples import make_sample

from reflow_hpc.config import StorageConfig
from reflow_hpc.storage.writer import ShardWriter

sys.path.insert(0, str(ROOT / "tools"))
import bench_trainer  # noqa: E402


def test_samples_are_read_from_every_collected_shard_and_those_without_generated_tokens_left_out(tmp_path):
    made = {}
    for owner in (1, 2):
        w = ShardWriter(tmp_path / "run" / "shards" / f"rank{owner:05d}", owner, StorageConfig())
        trajs = [make_sample(0, owner, i) for i in range(14)]
        w.append(trajs)
        w.close()
        made.update({t.sample_id: t for t in trajs if t.num_loss_tokens > 0})
    got = bench_trainer.run_samples(tmp_path / "run")
    assert sorted(t.sample_id for t in got) == sorted(made) and len(made) < 28     # kinds 0 and 1 have no response
    assert all((t.tokens == made[t.sample_id].tokens).all() for t in got)

    batch = bench_trainer.batches(got, 6, 2, seed=0)[0]
    lengths = sorted(len(it.trajectory.tokens) for it in batch)
    assert bench_trainer.passes(batch, 4, 0) == (2, 4 * lengths[3] + 2 * lengths[5], sum(lengths),
                                                 max(4 * lengths[3], 2 * lengths[5]))
    assert bench_trainer.passes(batch, 6, 1)[0] == 6                      # a cap below every sample: one pass each


def test_a_run_without_shards_is_refused_naming_the_directory(tmp_path):
    with pytest.raises(SystemExit, match=f"{tmp_path / 'shards'}: no shard directories"):
        bench_trainer.run_samples(tmp_path)
