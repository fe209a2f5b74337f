"""The versions the ONNX export is verified on, and the check of the installed ones."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .. import envs

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
    if off and not envs.METRALE_ONNX_UNVERIFIED:
        span = ", ".join(f"{p} {'.'.join(map(str, lo))}-{'.'.join(map(str, hi))}" for p, (lo, hi) in VERIFIED.items())
        raise RuntimeError(f"the ONNX export is verified on {span}; found {', '.join(off)} "
                           "(set METRALE_ONNX_UNVERIFIED=1 to try anyway)")
