"""Exported graphs are written whole or not at all (metrale_graph/onnx/files.py): a failure of the
write, of onnx.checker or a Ctrl-C leaves no file, no partial file and no scratch folder, and a
file already at the path as it was. Tiny hand-built graphs: no export needed."""

import os

import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from metrale_graph.onnx import save_onnx  # noqa: E402
from metrale_graph.onnx.files import staged  # noqa: E402


def _graph(scale: float, einsum_bf16: bool = False):
    """y = x * w (w an initializer); einsum_bf16: an Einsum on bfloat16, which ONNX's type rules refuse
    (what the MoE translation once exported)."""
    import numpy as np

    if einsum_bf16:
        node = helper.make_node("Einsum", ["x", "w"], ["y"], equation="i,i->i")
        dtype, w = TensorProto.BFLOAT16, helper.make_tensor("w", TensorProto.BFLOAT16, [4], [1, 2, 3, 4])
    else:
        node = helper.make_node("Mul", ["x", "w"], ["y"])
        dtype, w = TensorProto.FLOAT, numpy_helper.from_array(np.full(4, scale, np.float32), "w")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", dtype, [4])],
                              [helper.make_tensor_value_info("y", dtype, [4])], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


class _Program:
    """Stands in for an ONNXProgram: save() writes the graph, its weights in `<name>.data` when
    external, and may fail part way (after the graph file, before its side file is complete)."""

    def __init__(self, model, external=False, fail: type[BaseException] | None = None):
        self.model, self.external, self.fail = model, external, fail

    def save(self, path):
        onnx.save_model(self.model, path, save_as_external_data=self.external,
                        location=os.path.basename(path) + ".data", size_threshold=0)
        if self.fail:
            with open(path + ".data", "ab") as f:
                f.write(b"torn")
            raise self.fail("injected after the write started")


def _listing(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("external", [False, True], ids=["one-file", "external-data"])
def test_a_saved_graph_is_complete_and_checked(tmp_path, external):
    path = tmp_path / "step.onnx"
    steps = []
    save_onnx(_Program(_graph(2.0), external), path, progress=steps.append)
    assert steps == ["save", "check_model"]
    assert _listing(tmp_path) == (["step.onnx", "step.onnx.data"] if external else ["step.onnx"])
    onnx.checker.check_model(str(path), full_check=True)
    assert numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0]).tolist() == [2.0] * 4


@pytest.mark.parametrize("fail", [OSError, KeyboardInterrupt], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("external", [False, True], ids=["one-file", "external-data"])
def test_a_failure_after_the_write_started_leaves_no_file(tmp_path, external, fail):
    """ONNXProgram.save wrote to the final path: a failure part way left a torn file there."""
    path = tmp_path / "step.onnx"
    with pytest.raises(fail, match="injected"):
        save_onnx(_Program(_graph(2.0), external, fail=fail), path)
    assert _listing(tmp_path) == []


def test_a_graph_onnx_checker_refuses_is_not_written(tmp_path):
    """The bf16 MoE export was saved, then failed check_model (Einsum takes no bfloat16), leaving the
    invalid file behind."""
    path = tmp_path / "step.onnx"
    with pytest.raises(RuntimeError, match=r"fails onnx.checker, so .*step.onnx was not written: .*Einsum"):
        save_onnx(_Program(_graph(2.0, einsum_bf16=True)), path)
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("external", [False, True], ids=["one-file", "external-data"])
def test_a_failed_save_leaves_the_previous_file_as_it_was(tmp_path, external):
    path = tmp_path / "step.onnx"
    save_onnx(_Program(_graph(2.0), external), path)
    before = {name: (tmp_path / name).read_bytes() for name in _listing(tmp_path)}
    with pytest.raises(KeyboardInterrupt):
        save_onnx(_Program(_graph(3.0), external, fail=KeyboardInterrupt), path)
    assert {name: (tmp_path / name).read_bytes() for name in _listing(tmp_path)} == before
    save_onnx(_Program(_graph(3.0), external), path)  # and a good save replaces it
    assert numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0]).tolist() == [3.0] * 4


def test_staged_puts_side_files_back_when_interrupted_before_the_last_rename(tmp_path, monkeypatch):
    """The side files move first and the file itself last; an interruption between the two puts the
    side file that was replaced back, so the old file never points at new weights."""
    (tmp_path / "m.onnx").write_text("old graph")
    (tmp_path / "m.onnx.data").write_text("old weights")
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == "m.onnx" and ".partial" in src:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        with staged(tmp_path / "m.onnx") as scratch:
            with open(scratch, "w") as f:
                f.write("new graph")
            with open(scratch + ".data", "w") as f:
                f.write("new weights")
    assert _listing(tmp_path) == ["m.onnx", "m.onnx.data"]
    assert (tmp_path / "m.onnx").read_text() == "old graph" and (tmp_path / "m.onnx.data").read_text() == "old weights"


def test_staged_refuses_a_block_that_wrote_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="nothing was written for .*m.onnx"):
        with staged(tmp_path / "m.onnx"):
            pass
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("program, error", [
    (_Program(_graph(2.0), external=True, fail=KeyboardInterrupt), SystemExit),  # (the tool's Ctrl-C: exit 130)
    (_Program(_graph(2.0, einsum_bf16=True)), RuntimeError),
], ids=["ctrl-c-while-saving", "check_model-fails"])
def test_export_tool_leaves_no_file_when_the_save_fails(tmp_path, monkeypatch, program, error):
    """tools.export_onnx -o PATH saved to PATH and checked it there: the bf16 MoE export left its
    invalid file behind."""
    import metrale_graph.onnx
    from metrale_graph.tools import export_onnx

    monkeypatch.setattr(metrale_graph.onnx, "export_prefill", lambda *args, **kwargs: program)
    with pytest.raises(error) as raised:
        export_onnx.main(["-B", "2", "-T", "16", "--slots", "2", "--blocks", "4", "--block-size", "16",
                          "--max-context", "32", "--dtype", "float32", "-o", str(tmp_path / "step.onnx")])
    assert error is not SystemExit or raised.value.code == 130
    assert _listing(tmp_path) == []


def test_a_path_that_cannot_be_written_is_refused_before_anything_is(tmp_path):
    """A folder, or a file in a folder that does not exist: a ValueError naming the path, before the save (it was
    a FileNotFoundError / IsADirectoryError naming the hidden scratch folder, the latter after the whole write)."""
    saved = []

    class Program:
        def save(self, path):
            saved.append(path)

    (tmp_path / "dir.onnx").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        save_onnx(Program(), tmp_path / "dir.onnx")
    with pytest.raises(ValueError, match="does not exist"):
        save_onnx(Program(), tmp_path / "missing" / "x.onnx")
    assert saved == [] and _listing(tmp_path) == ["dir.onnx"]
