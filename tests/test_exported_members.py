"""The public face: aiolimit re-exports exactly its public names, sorted."""

from __future__ import annotations

import aiolimit


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted, and every public top-level name is in it and importable."""
    assert aiolimit.__all__ == sorted(aiolimit.__all__)
    public = {
        name
        for name, value in vars(aiolimit).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("aiolimit")
    }
    assert public == set(aiolimit.__all__)
    for name in aiolimit.__all__:
        assert getattr(aiolimit, name).__module__.startswith("aiolimit._"), name


def test_errors_form_one_tree() -> None:
    """Every exception aiolimit exports derives from AiolimitError."""
    errors = [v for v in map(aiolimit.__dict__.get, aiolimit.__all__) if isinstance(v, type)]
    for error in (e for e in errors if issubclass(e, BaseException)):
        assert issubclass(error, aiolimit.AiolimitError), error
    assert issubclass(aiolimit.ConfigurationError, ValueError)
    assert issubclass(aiolimit.InvalidRequestError, ValueError)
