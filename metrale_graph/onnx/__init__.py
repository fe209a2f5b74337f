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

from .versions import VERIFIED, check_versions
from .export import (PrefillStep, example_inputs, export_onnx, export_prefill, functional_ops,
                     node_counts, ort_session, run_step, step_args, translation, twin)
from .files import save_onnx

__all__ = ["VERIFIED", "check_versions", "PrefillStep", "example_inputs", "export_onnx", "export_prefill",
           "functional_ops", "node_counts", "ort_session", "run_step", "save_onnx", "step_args", "translation",
           "twin"]
