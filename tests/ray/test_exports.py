"""The curated public surface of actors/ and cluster/ (STYLE §11)."""

from __future__ import annotations

import inspect

import pytest

import actors
import cluster


@pytest.mark.parametrize("package", [actors, cluster])
def test_exports_are_exactly_the_public_names(package):
    public = {
        name
        for name, value in vars(package).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert set(package.__all__) == public
    assert len(package.__all__) == len(set(package.__all__))
