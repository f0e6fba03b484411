"""Shared fixtures: seeded random generators whose seed shows in the test id and repr."""
import numpy as np
import pytest


class Rand(np.random.Generator):
    """A numpy Generator that remembers its seed, so a failing case can be replayed."""

    def __init__(self, seed):
        super().__init__(np.random.PCG64(seed))
        self.seed = seed

    def __repr__(self):
        return f"Rand(seed={self.seed})"


@pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
def rand(request):
    return Rand(request.param)
