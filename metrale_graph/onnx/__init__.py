"""ONNX export of the packed prefill step, every metrale op as standard ONNX operators
(metrale_graph.onnx; needs the `onnx` extra: onnx, onnxscript, onnxruntime).

    from metrale_graph.onnx import export_prefill, save_onnx
    save_onnx(export_prefill(model, cache, batch_size=4, num_tokens=256), "prefill.onnx")

(`save_onnx` writes the file whole, checked by onnx.checker, or not at all; `ONNXProgram.save` writes
in place.)

The export goes through torch.export and torch.onnx's dynamo exporter with custom translations
written in onnxscript, whose interfaces change between releases. It is verified (the CPU suite's
tests/test_onnx.py) on the versions in VERIFIED; on others `check_versions` raises a RuntimeError
naming them (set METRALE_ONNX_UNVERIFIED=1 to try anyway).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

# package -> (lowest, highest) verified major.minor
VERIFIED = {"torch": ((2, 11), (2, 13)), "onnxscript": ((0, 7), (0, 7))}


def check_versions() -> None:
    found = {}
    for package in VERIFIED:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            raise RuntimeError(f"the ONNX export needs {package}: pip install 'metrale-graph[onnx]'") from None
    def major_minor(v: str) -> tuple[int, int]:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:2])
    off = [f"{p} {found[p]}" for p, (lo, hi) in VERIFIED.items() if not lo <= major_minor(found[p]) <= hi]
    if off and os.environ.get("METRALE_ONNX_UNVERIFIED") != "1":
        span = ", ".join(f"{p} {'.'.join(map(str, lo))}-{'.'.join(map(str, hi))}" for p, (lo, hi) in VERIFIED.items())
        raise RuntimeError(f"the ONNX export is verified on {span}; found {', '.join(off)} "
                           "(set METRALE_ONNX_UNVERIFIED=1 to try anyway)")


from .export import (PrefillStep, example_inputs, export_onnx, export_prefill, functional_ops,  # noqa: E402
                     node_counts, ort_session, run_step, step_args, translation, twin)
from .files import save_onnx  # noqa: E402

__all__ = ["VERIFIED", "check_versions", "PrefillStep", "example_inputs", "export_onnx", "export_prefill",
           "functional_ops", "node_counts", "ort_session", "run_step", "save_onnx", "step_args", "translation",
           "twin"]
