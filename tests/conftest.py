import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A complete tiny random base-model checkpoint directory, written once per test session."""
    from voxserve.models.qwen3_tts.testing import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-base"))
