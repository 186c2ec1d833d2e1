"""The login-node side of submission that needs no cluster: time limits and failure reports."""

from __future__ import annotations

import pytest

from reflow_hpc.config import ConfigError
from reflow_hpc.submit import _minutes, failure_lines


@pytest.mark.parametrize("text, minutes", [("45", 45), ("02:30:00", 150), ("00:20:01", 21), ("1-02", 1560),
                                           ("1-00:30:00", 1470), ("1-02:30", 1590), ("30:00", 30), ("3:15", 4)])
def test_slurm_time_syntax(text, minutes):
    assert _minutes(text) == minutes


def test_bad_time_names_the_key():
    with pytest.raises(ConfigError, match="slurm.time"):
        _minutes("an hour")


SUBMITIT_HEADER = ("submitit INFO (2026-11-29 21:05:59,123) - Starting with JobEnvironment(job_id=38)\n"
                   "submitit INFO (2026-11-29 21:05:59,123) - Loading pickle: /logs/38/38_submitted.pkl\n")


def test_failure_lines_prefer_our_one_line_errors():
    log = SUBMITIT_HEADER + "Traceback (most recent call last):\n  File x\nreflow_hpc: rank 2 (n2, pid 7): fetch failed: boom\n"
    assert failure_lines(log) == ["reflow_hpc: rank 2 (n2, pid 7): fetch failed: boom"]


def test_failure_lines_fall_back_to_the_tail_without_submitit_progress():
    log = SUBMITIT_HEADER + ("submitit ERROR (2026-11-29 21:06:00,001) - Submitted job triggered an exception\n"
                             "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                             "RuntimeError: rank 3 exited with code 1\n\n")
    assert failure_lines(log) == ["Traceback (most recent call last):", "  File \"x.py\", line 1, in f",
                                  "RuntimeError: rank 3 exited with code 1"]
    assert failure_lines(SUBMITIT_HEADER) == []
