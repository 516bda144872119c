"""``benchmarks.host_profile``: a call's host time queued and drained, and its functions by own time."""

import numpy as np

from benchmarks.host_profile import TOP, host_lines


def test_host_lines_name_the_functions_that_take_the_time():
    drained = []

    def call():
        return np.linalg.svd(np.ones((40, 40)))

    lines = host_lines("svd", call, lambda: drained.append(1), calls=5)
    assert lines[0].startswith("svd: ") and "us a call queued" in lines[0]
    assert len(drained) == 1 + 1 + 5 + 1  # after the first call, the queued ones, each drained one, the profile
    assert 1 < len(lines) <= TOP + 1
    assert any("svd" in line for line in lines[1:])
