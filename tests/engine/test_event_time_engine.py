"""Event time without Spark: the sessions' segmented running max against a plain loop. The
built-ins checked against Spark itself are tests/spark/test_event_time.py's."""
import numpy as np


def test_segmented_running_max_restarts_at_each_group():
    from pyspark_glue.sessions import segmented_running_max

    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 100):
        values = rng.integers(0, 50, n)
        starts = np.flatnonzero(np.r_[True, rng.random(n - 1) < 0.3]) if n else np.zeros(0, dtype=np.int64)
        expected, bounds = [], list(starts) + [n]
        for a, b in zip(bounds[:-1], bounds[1:]):
            expected += list(np.maximum.accumulate(values[a:b]))
        assert segmented_running_max(values, starts).tolist() == expected
