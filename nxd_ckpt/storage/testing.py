"""Test-only storage hooks: the ``mem://`` (in-process dict) and ``objdir://`` (a directory of objects several
processes share) object stores. They prove the object-store code paths without a server, but a checkpoint
saved to ``mem://`` is lost when the process exits, so the public API refuses both schemes until a test
calls ``enable_test_schemes()`` in every process that uses them (multi-rank tests do it at import of the
module that holds the rank function, which each rank process imports)."""
from __future__ import annotations

from . import TEST_SCHEMES, _ENABLED_TEST_SCHEMES


def enable_test_schemes() -> None:
    """Let ``check_location`` / ``open_storage`` (so every entry point) accept ``mem://`` and ``objdir://``
    URLs in this process. Never called by the library itself."""
    _ENABLED_TEST_SCHEMES.update(TEST_SCHEMES)


def disable_test_schemes() -> None:
    """Refuse ``mem://`` and ``objdir://`` again (the default)."""
    _ENABLED_TEST_SCHEMES.clear()
