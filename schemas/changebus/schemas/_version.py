"""The changebus version (kept equal to pyproject.toml's by tests/test_layout.py)."""

__version__ = "0.1.0"
