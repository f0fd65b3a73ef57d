import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def one_torch_thread():
    """Tiny models on a shared 2-core box run far faster single-threaded."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A complete tiny random base-model checkpoint directory, written once per test session."""
    from legato.models.qwen3_tts.testing import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-base"))
