"""grammar._xgrammar's errors: xgrammar absent names the package to install; xgrammar present but one of its own
dependencies missing (the device machine lacked pydantic) names that dependency instead of claiming xgrammar
is not installed. Runs with or without xgrammar installed (a finder stands in for it)."""

import importlib.abc
import importlib.machinery
import sys

import pytest

from metrale_graph.grammar import _xgrammar
from metrale_graph.structured import StructuredOutputError


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `xgrammar` and fails while executing it, as an import of a missing dependency does."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "xgrammar" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ModuleNotFoundError("No module named 'pydantic_core'", name="pydantic_core")


def test_xgrammar_absent_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # (import then fails as for a package not installed)
    with pytest.raises(StructuredOutputError, match=r"needs the xgrammar package: pip install 'metrale-graph\[serve\]'"):
        _xgrammar()


def test_a_dependency_of_xgrammar_missing_is_named(monkeypatch):
    monkeypatch.delitem(sys.modules, "xgrammar", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Finder()] + sys.meta_path)
    with pytest.raises(StructuredOutputError, match="xgrammar is installed but does not import") as e:
        _xgrammar()
    assert "pydantic_core" in str(e.value) and "needs the xgrammar package" not in str(e.value)
