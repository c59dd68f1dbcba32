"""Output poisoning, the test suite's: every result pool_tuner allocates is filled before its kernel
runs -- NaN, indices with ``INDEX_POISON`` -- so that an element a kernel forgets to write cannot
pass a comparison by accident.  ``conftest.py`` installs it for the whole suite as
``plans.result_fill``, the one place every front end asks what a new result holds."""

import numpy as np

from pool_tuner import plans

INDEX_POISON = np.iinfo(np.int64).min
#: The library's own rule: only results with nothing to compute are filled (with zeros).
UNPOISONED = plans.result_fill


def poisoned_fill(dtype: str, zero: bool):
    """``plans.result_fill`` with every other result poisoned."""
    if zero:
        return 0
    return INDEX_POISON if dtype == "int64" else float("nan")


def install() -> None:
    plans.result_fill = poisoned_fill
