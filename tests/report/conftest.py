"""Fixtures for the report tests: the committed input files, the CLI in-process, and helpers that
check the Markdown's tables and image links."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES
