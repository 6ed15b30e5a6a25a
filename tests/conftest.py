"""Shared pytest setup for the whole suite. Keep it minimal: fixtures live beside their tests."""

from companion.kernels import interpret_on_cpu

# Triton kernels run interpreted on CPU tensors where no CUDA GPU is present; Triton reads
# the switch when a kernel is defined, so it is set before any test module imports one.
interpret_on_cpu()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "browser: loads the built HTML book (_build/html) in Chromium; run after `make book`",
    )
