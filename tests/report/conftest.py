"""Fixtures for the report tests: the committed input files.  The CLI is tests/conftest.py's `cli`;
the checks of the Markdown's tables and image links are in report_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES
