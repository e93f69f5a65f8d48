import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch or a broken driver: no GPU tests
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
