"""How a trainer replica cuts its length-sorted samples into passes (trainer.micro_batch_size, .micro_batch_tokens)."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings, strategies as st

from reflow_hpc.train.trainer import micro_batches


def fits(lengths, max_samples, max_tokens):
    return len(lengths) == 1 or (len(lengths) <= max_samples
                                 and (max_tokens == 0 or len(lengths) * max(lengths) <= max_tokens))


def fewest(lengths, max_samples, max_tokens):
    """The fewest runs any split of the sorted lengths into fitting runs has (exhaustive)."""
    @cache
    def best(i):
        if i == len(lengths):
            return 0
        return min(1 + best(j) for j in range(i + 1, len(lengths) + 1) if fits(lengths[i:j], max_samples, max_tokens))
    return best(0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=24), st.integers(1, 9), st.sampled_from([0, 1, 40, 96, 300]))
def test_runs_cover_the_samples_in_order_within_the_caps_and_are_fewest(lengths, max_samples, max_tokens):
    lengths = tuple(sorted(lengths))
    runs = micro_batches(lengths, max_samples, max_tokens)
    assert [i for r in runs for i in range(len(lengths))[r]] == list(range(len(lengths)))
    assert all(fits(lengths[r], max_samples, max_tokens) for r in runs)
    assert len(runs) == fewest(lengths, max_samples, max_tokens)


def test_no_token_cap_is_fixed_size_passes_and_a_long_sample_passes_alone():
    assert micro_batches([5] * 7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    # 16 sequences padded to 200 tokens (3,200) become 12 short ones and 4 long ones: 1,320 + 800 padded tokens
    assert micro_batches([100] * 12 + [200] * 4, 16, 1600) == [slice(0, 12), slice(12, 16)]
    assert micro_batches([10, 10, 500, 600], 8, 400) == [slice(0, 2), slice(2, 3), slice(3, 4)]
    assert micro_batches([], 4, 100) == []
