"""metrale_graph.envs: every METRALE_* variable parsed in one place, once; bad values and unknown names a
ValueError naming them; the backend switches still chosen by the environment."""

import os
import subprocess
import sys

import pytest

from metrale_graph import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_when_no_variable_is_set():
    values = envs.read({"PATH": "/bin", "OTHER_METRALE_X": "1"})  # only METRALE_* names are ours
    assert values == {name: s.default for name, s in envs.SETTINGS.items()}
    assert values["METRALE_FP8_DECODE"] == "splitk" and values["METRALE_FP8_ACTIVATIONS"] is True
    assert values["METRALE_ONNX_UNVERIFIED"] is False and values["METRALE_COMMIT"] is None


@pytest.mark.parametrize("raw, value", [("1", True), ("on", True), ("TRUE", True), ("yes", True), ("0", False),
                                        ("off", False), ("False", False), (" no ", False)])
def test_flags_take_the_usual_words(raw, value):
    assert envs.read({"METRALE_FP8_ACTIVATIONS": raw})["METRALE_FP8_ACTIVATIONS"] is value
    assert envs.read({"METRALE_ONNX_UNVERIFIED": raw})["METRALE_ONNX_UNVERIFIED"] is value


def test_choices_and_text():
    values = envs.read({"METRALE_GDN_CHUNKED": "fla", "METRALE_FP8_DECODE": "w8a16", "METRALE_COMMIT": "abc1234"})
    assert values["METRALE_GDN_CHUNKED"] == "fla" and values["METRALE_FP8_DECODE"] == "w8a16"
    assert values["METRALE_COMMIT"] == "abc1234" and values["METRALE_FP8_ACTIVATIONS"] is True
    assert envs.choices("METRALE_FP8_DECODE") == ("splitk", "w8a16")


@pytest.mark.parametrize("environ, message", [
    ({"METRALE_MOE_SORT": "count"}, "METRALE_MOE_SORT is not a metrale-graph setting"),  # removed
    ({"METRALE_MOE_DECODE": "direct"}, "METRALE_MOE_DECODE is not a metrale-graph setting"),  # removed
    ({"METRALE_GDN_CHUNKED": "FLA"}, "METRALE_GDN_CHUNKED must be one of triton, fla, got 'FLA'"),
    ({"METRALE_FP8_DECODE": "swap"}, "METRALE_FP8_DECODE must be one of splitk, w8a16, got 'swap'"),  # removed form
    ({"METRALE_FP8_EXPERTS": "plain"}, "METRALE_FP8_EXPERTS is not a metrale-graph setting"),  # removed
    ({"METRALE_GDN_CHUNKED": ""}, "METRALE_GDN_CHUNKED must be one of triton, fla, got ''"),
    ({"METRALE_ATTENTION_PREFILL": "fa2"}, "METRALE_ATTENTION_PREFILL is not a metrale-graph setting"),  # removed
    ({"METRALE_FP8_ACTIVATIONS": "maybe"}, "METRALE_FP8_ACTIVATIONS is a flag: one of 1, true, on, yes, 0, false, off, "
                                           "no, got 'maybe'"),
    ({"METRALE_GDN_CHUNK": "fla"}, "METRALE_GDN_CHUNK is not a metrale-graph setting (did you mean "
                                   "METRALE_GDN_CHUNKED?)"),
    ({"METRALE_MOE_EXPERTS": "grouped_mm"}, "METRALE_MOE_EXPERTS is not a metrale-graph setting"),  # removed
    ({"METRALE_XYZZY": "1"}, "METRALE_XYZZY is not a metrale-graph setting; the settings: METRALE_GDN_CHUNKED"),
])
def test_bad_values_and_unknown_names_are_named(environ, message):
    with pytest.raises(ValueError) as info:
        envs.read(environ)
    assert message in str(info.value)


def test_every_problem_is_named_at_once():
    with pytest.raises(ValueError) as info:
        envs.read({"METRALE_GDN_CHUNKED": "flash", "METRALE_FP8_DECODES": "w8a16", "METRALE_REPORT": "/tmp/r.jsonl"})
    assert "METRALE_GDN_CHUNKED must be one of triton, fla, got 'flash'" in str(info.value)
    assert "METRALE_FP8_DECODES is not a metrale-graph setting (did you mean METRALE_FP8_DECODE?)" in str(info.value)


def test_values_are_read_once(monkeypatch):
    before = envs.METRALE_FP8_DECODE  # read at the package's import, by ops.fp8.linear
    monkeypatch.setenv("METRALE_FP8_DECODE", "w8a16" if before == "splitk" else "splitk")
    monkeypatch.setenv("METRALE_NOT_A_SETTING", "1")  # unknown, but the environment is not read again
    assert envs.METRALE_FP8_DECODE == before


def test_override_parses_like_the_environment_and_restores():
    with envs.override(METRALE_ONNX_UNVERIFIED="on", METRALE_COMMIT="f00"):
        assert envs.METRALE_ONNX_UNVERIFIED is True and envs.METRALE_COMMIT == "f00"
    assert envs.METRALE_COMMIT == envs.read()["METRALE_COMMIT"]
    with pytest.raises(RuntimeError), envs.override(METRALE_COMMIT="f00"):
        raise RuntimeError
    assert envs.METRALE_COMMIT == envs.read()["METRALE_COMMIT"]
    with pytest.raises(ValueError, match="METRALE_FP8_DECODE must be one of splitk, w8a16, got 'swap'"):
        with envs.override(METRALE_FP8_DECODE="swap"):
            pass
    with pytest.raises(ValueError, match="METRALE_COMIT is not a metrale-graph setting .did you mean METRALE_COMMIT"):
        with envs.override(METRALE_COMIT="f00"):
            pass
    with pytest.raises(AttributeError):
        envs.METRALE_COMIT


_BACKENDS = """
from metrale_graph.ops import fp8, gdn_recurrence
from metrale_graph.ops.fp8 import linear
print(gdn_recurrence.CHUNKED_BACKEND, linear.DECODE_GEMM, fp8.activations_rounded())
"""


def _run(code: str, **variables: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, **variables}, capture_output=True,
                          text=True, timeout=300)


def test_the_environment_still_chooses_the_backends():
    """Each backend switch reaches its op module's attribute from the environment, as before the settings
    had one module; a misspelt variable stops the import, naming it, where it was silently ignored."""
    run = _run(_BACKENDS, METRALE_GDN_CHUNKED="fla", METRALE_FP8_DECODE="w8a16", METRALE_FP8_ACTIVATIONS="off")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["fla", "w8a16", "False"]
    typo = _run(_BACKENDS, METRALE_FP8_DECODES="w8a16")
    assert typo.returncode != 0
    assert ("ValueError: environment: METRALE_FP8_DECODES is not a metrale-graph setting (did you mean "
            "METRALE_FP8_DECODE?)") in typo.stderr, typo.stderr[-2000:]
