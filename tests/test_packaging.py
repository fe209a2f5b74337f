"""Package metadata: what `make` installs and what the extras promise."""

import os
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_onnx_extra_pins_the_verified_versions():
    """The onnx extra allowed onnxscript>=0.5 while metrale_graph.onnx.VERIFIED accepts only 0.7 (the export
    then refuses to run): each verified package's requirement in the extra takes exactly its verified
    major.minor range."""
    from packaging.requirements import Requirement

    from metrale_graph.onnx import VERIFIED

    extra = {r.name: r.specifier for r in map(Requirement, _project()["optional-dependencies"]["onnx"])}
    for package, ((lo_major, lo_minor), (hi_major, hi_minor)) in VERIFIED.items():
        assert package in extra, f"the onnx extra does not pin {package} (VERIFIED has it)"
        spec = extra[package]
        assert spec.contains(f"{lo_major}.{lo_minor}.0") and spec.contains(f"{hi_major}.{hi_minor}.99"), (package, spec)
        assert not spec.contains(f"{hi_major}.{hi_minor + 1}.0"), (package, spec)
        if lo_minor:
            assert not spec.contains(f"{lo_major}.{lo_minor - 1}.99"), (package, spec)


@pytest.mark.parametrize("field", ["license", "license-files"])
def test_license_is_the_license_file(field):
    """`license = { text = ... }` filled make's output with setuptools' deprecation warnings (setuptools >= 77)
    and the string form is refused by older setuptools (the GPU machine installs with its own): no license
    field; setuptools ships LICENSE by itself."""
    assert field not in _project()
    assert not any(c.startswith("License ::") for c in _project().get("classifiers", []))  # deprecated too
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(200)
