"""Per-stage peak memory (compress.rss): a stage's peak is its own, the run's peak keeps every stage's."""
import numpy as np

from compress import rss


def test_a_stage_peak_is_its_own_and_the_run_peak_keeps_the_largest():
    rss.new_stage()
    big = np.ones(200 * 2**20 // 8)  # 200 MB, touched
    first = rss.peak_mb()
    assert first >= rss.resident_mb() > 150
    del big
    rss.new_stage()
    assert rss.peak_mb() < first - 150  # the next stage does not inherit the first one's peak
    assert rss.run_peak_mb() >= first - 1  # the kernel's counters are batched: a few pages of jitter
    assert rss.resident_mb() <= rss.peak_mb() + 1
