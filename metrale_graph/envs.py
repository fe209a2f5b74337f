"""Every METRALE_* environment variable the package reads, in one table (SETTINGS): name, type, default, meaning.

Read through one accessor, the module's attributes (`envs.METRALE_GDN_CHUNKED`), and read once: the first access
parses every METRALE_* variable of the environment and keeps the values for the life of the process. A value a
setting does not take, or a METRALE_* variable that is none of SETTINGS (a misspelt name), is a
ValueError naming each such variable and what it takes, raised at that first access, which importing the package
makes (the backend switches below are read when their op modules are imported).

The backend switches become module attributes of their op (ops.gdn_recurrence.CHUNKED_BACKEND,
ops.fp8.linear.DECODE_GEMM) when it is imported; code may set those attributes afterwards, before a step is compiled
or captured, and the op checks them again where it reads them. Tests read settings under other values with `override`.
docs/DESIGN.md ("Settings") shows the table (`markdown_table`).
"""

from __future__ import annotations

import contextlib
import difflib
import os
from dataclasses import dataclass
from typing import Any

PREFIX = "METRALE_"
FLAG_WORDS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


@dataclass(frozen=True)
class Setting:
    """One environment variable: `kind` "choice" (one of `choices`), "flag" (FLAG_WORDS, any case) or "text" (any
    string); `default` is its value when the variable is unset; `meaning` is one line for the docs table."""

    name: str
    kind: str
    default: Any
    meaning: str
    choices: tuple[str, ...] = ()

    def parse(self, raw: str) -> Any:
        """The value of `raw` as this setting takes it; ValueError naming the variable and what it takes."""
        if self.kind == "choice":
            if raw not in self.choices:
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, got {raw!r}")
            return raw
        if self.kind == "flag":
            word = raw.strip().lower()
            if word not in FLAG_WORDS:
                raise ValueError(f"{self.name} is a flag: one of {', '.join(FLAG_WORDS)}, got {raw!r}")
            return FLAG_WORDS[word]
        return raw

    @property
    def type_text(self) -> str:
        return " \\| ".join(f"`{c}`" for c in self.choices) if self.kind == "choice" else self.kind

    @property
    def default_text(self) -> str:
        if self.default is None:
            return "unset"
        if self.kind == "flag":
            return "on" if self.default else "off"
        return f"`{self.default}`"


def _settings(*settings: Setting) -> dict[str, Setting]:
    return {s.name: s for s in settings}


SETTINGS = _settings(
    # backend switches: the op module that reads each at import, and its attribute
    Setting("METRALE_GDN_CHUNKED", "choice", "triton",
            "the GDN recurrence's chunked path: our kernels or flash-linear-attention 0.6.0 on an aligned layout "
            "(ops.gdn_recurrence.CHUNKED_BACKEND). fla is kept: it serves the head dims ours do not take whatever "
            "the setting, and chosen for all it is the GPU tests' second opinion and the A/B baseline (1.5x slower "
            "than ours at the 9B's heads on the H200)", ("triton", "fla")),
    Setting("METRALE_FP8_DECODE", "choice", "splitk",
            "the FP8 linear's GEMM for decode rows (1 to 32) on CUDA: splitk, W8A8 (x rounded to FP8 128-groups; "
            "split-K up to 16 rows, cuBLAS above), or w8a16, weight-only FP8 (x kept in bf16, the weights dequantized "
            "in registers; ops/fp8/w8a16.py). w8a16 lost the H200 A/B (984b18e: 9B-FP8 D1 5.71 against 5.34 ms, "
            "D32 8.74 against 8.15; BENCHMARKS.md): opt-in only while its kernel is reworked, removed if it loses "
            "again (ops.fp8.linear.DECODE_GEMM)", ("splitk", "w8a16")),
    Setting("METRALE_DECODE_GEMV", "choice", "cublas",
            "the dense bf16 / fp16 projections at decode rows (1 to 16) on CUDA: cublas (x @ w.t(), torch.addmm), or "
            "triton, our one-launch split-K GEMV (ops/gemv.py: deterministic, the residual in its epilogue; "
            "tests/test_gemv.py passed on an H100 at 32df38b); opt-in until an H200 A/B says it pays (ops.gemv.BACKEND)",
            ("cublas", "triton")),
    Setting("METRALE_MOE_SHARED_STREAM", "flag", False,
            "the MoE op's shared expert on a second CUDA stream beside the routed experts (forked after the GEMM "
            "that also makes the router's logits, joined before the combine; captured into the same CUDA graphs): "
            "the same kernels, the same output bit for bit. Opt-in until a GPU A/B says it pays (ops.moe.SHARED_STREAM)"),
    Setting("METRALE_VERIFY_PIECES", "text", None,
            "the speculative verify step's CUDA graphs: layer counts of the leading pieces, comma-separated (e.g. "
            "`1,3,8`; the remaining layers are the last piece), launched one after another so that the GPU starts "
            "on the first while the host launches the rest; `0`: one graph of all layers; unset: the runner's "
            "default (capture/runner.py, verify_pieces)"),
    Setting("METRALE_MTP_AFTER", "flag", False,
            "speculative \"mtp\" steps whose streams are all decodes the head follows run its drafting right behind "
            "the captured acceptance, one read back for both (speculative/drafting.py, MtpDrafter.launch_after); off: "
            "the drafting after the acceptance's read back. Opt-in until the spec bench says it pays (its CUDA graphs "
            "passed tests/test_gpu_speculative_graphs.py on an H100 at 32df38b)"),
    Setting("METRALE_VERIFY_AHEAD", "flag", True,
            "speculative \"mtp\" verify step N + 1 launched before step N's accept counts reach the host, its inputs "
            "made on the device from N's (decodes the head follows, no prefix caching: speculative/ahead.py); "
            "takes the drafting behind the acceptance. On since its H100 run (benchmarks/HISTORY.md, 3ea35a8: "
            "9B, k 2, 4-5% off the synchronous MTP step at 1 and 8 streams); 0: the synchronous step"),
    # debug and tool options
    Setting("METRALE_FP8_ACTIVATIONS", "flag", True,
            "FP8 projections round activations to FP8 (W8A8); off: weight-only FP8, a debug mode "
            "(ops.fp8.activation_rounding)"),
    Setting("METRALE_ONNX_UNVERIFIED", "flag", False,
            "the ONNX export runs on torch / onnxscript versions outside metrale_graph.onnx.VERIFIED"),
    Setting("METRALE_API_KEY", "text", None, "metrale-serve's --api-key when the flag is not given"),
    Setting("METRALE_COMMIT", "text", None,
            "the commit benchmark records name, for a copy of a tree whose .git is not its own (tools/provenance.py)"),
    Setting("METRALE_REPORT", "text", None,
            "a file tests/test_gpu_sweep.py appends one JSON line per batch to (benchmarks/gpu_session.sh sweep)"),
)

_values: dict[str, Any] | None = None


def read(environ=None) -> dict[str, Any]:
    """Every setting's value from `environ` (default os.environ): the parsed variable, else the default.
    ValueError naming each METRALE_* variable that is not a setting (with the nearest setting's name) and
    each value a setting does not take."""
    environ = os.environ if environ is None else environ
    values, problems = {name: s.default for name, s in SETTINGS.items()}, []
    for name in sorted(k for k in environ if k.startswith(PREFIX)):
        if name not in SETTINGS:
            problems.append(_not_a_setting(name))
            continue
        try:
            values[name] = SETTINGS[name].parse(environ[name])
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("environment: " + "; ".join(problems))
    return values


def _not_a_setting(name: str) -> str:
    # compared without the prefix, which every name shares
    near = difflib.get_close_matches(name.removeprefix(PREFIX), [s.removeprefix(PREFIX) for s in SETTINGS], n=1)
    hint = f" (did you mean {PREFIX}{near[0]}?)" if near else ""
    return f"{name} is not a metrale-graph setting{hint}; the settings: {', '.join(SETTINGS)}"


def _current() -> dict[str, Any]:
    global _values
    if _values is None:
        _values = read()
    return _values


def __getattr__(name: str) -> Any:
    if name in SETTINGS:
        return _current()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(SETTINGS))


def choices(name: str) -> tuple[str, ...]:
    """The values a "choice" setting takes (the op modules' tuples of backends)."""
    return SETTINGS[name].choices


@contextlib.contextmanager
def override(**raw: str):
    """Within the block, the named settings read as if the environment held these strings (parsed as the
    environment's are: a ValueError for a value a setting does not take or a name that is not a setting);
    the others keep theirs. For tests. Op module attributes already read at import keep their values."""
    global _values
    unknown = [name for name in raw if name not in SETTINGS]
    if unknown:
        raise ValueError("; ".join(map(_not_a_setting, unknown)))
    before = _current()
    parsed = read(raw)
    _values = {**before, **{name: parsed[name] for name in raw}}
    try:
        yield
    finally:
        _values = before


def markdown_table() -> str:
    """The settings as docs/DESIGN.md shows them: variable, type, default, meaning."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.type_text} | {s.default_text} | {s.meaning} |" for s in SETTINGS.values()]
    return "\n".join(rows)
