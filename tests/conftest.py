"""Shared pytest setup for the whole suite. Keep it minimal: fixtures live beside their tests."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "browser: loads the built HTML book (_build/html) in Chromium; run after `make book`",
    )
