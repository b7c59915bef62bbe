"""pytest fixtures and hooks only; shared helpers live in helpers.py."""
import os
import tempfile

import pytest

# Inductor's on-disk caches are keyed without our ops' schemas: code cached
# by a run against an older build of the extension would call the ops with
# old arguments. Each test session compiles into its own cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="attnres-inductor-"))

from helpers import DEVICES


def pytest_configure(config):
    # Slow tests run by default (CI runs everything); deselect them for a
    # quick run with: pytest -m "not slow" tests/python
    config.addinivalue_line(
        "markers", "slow: takes minutes on a 2-core CPU (inductor compiles); deselect with -m 'not slow'"
    )


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
