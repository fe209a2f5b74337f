"""GPU check of ops/attention_varlen (issue 24's attention lever), one run: what the library kernels return,
whether every implementation is exact, capture-safe and how fast, against metrale::paged_attention's
reference and its Triton fallback.

Sections, each in its own process (a CUDA fault in one loses only that one), each case in its own try:
  probe        raw cuDNN dense and FlashAttention-2 varlen calls on a ragged batch with zero-length
               streams inside and at the tail and spare tokens: output error, the log-sum-exp's shape,
               strides and units (which reading matches the reference), NaN in spare rows, spare tokens
               as an extra sequence instead
  correctness  every implementation against the reference (fp32 on upcast inputs) at 9B attention dims
               (HQ 16, HKV 4, HD 256) and odd ones (6 / 2 / 128, 4 / 1 / 80), batches with and without
               context, zero-length streams, spare tokens (also NaN-filled), a one-stream bucket, T < 129
  capture      CUDA graphs captured at buckets (4 streams, 2048 tokens) and (1, 2048), replayed with other
               lengths, contexts and zero-length padding streams: replay against eager and the reference
  timing       TFLOP/s (graph replay and eager) at 1 x 16384, 1 x 8192, 8 x 2048, 8 x 512 and 4 x 512 new
               after 2048 cached each; the library call alone; a sweep of the context kernel's configs at the
               last shape; the CUDA kernels each implementation launches (profile names)
Implementations (attention_varlen's backends): fa2, cudnn_fa2 (one-stream buckets cuDNN dense, else fa2);
triton: the op's 64-row Triton kernel, its fallback where the libraries do not take a call. (Its first run,
benchmarks/h200-attention-varlen-ops.json, also had cuDNN varlen, which failed under capture, and
FlashAttention over the pools, which torch 2.11 cannot run: both removed.)

This script runs the sections and sums them up; the cases and what they share are attention_varlen_cases.py,
the probe, correctness and capture sections attention_varlen_checks.py, the timing section
attention_varlen_timing.py (beside it: run from a checkout as below, the folder is on sys.path).

    python benchmarks/kernels/check_attention_varlen.py --json $OUT/attention_varlen.json    (after: pip install -e .)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_int
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table

import attention_varlen_cases
from attention_varlen_cases import IMPLS, TIMING_SHAPES, err_text
from attention_varlen_checks import section_capture, section_correctness, section_probe
from attention_varlen_timing import section_timing

SECTIONS = ("probe", "correctness", "capture", "timing")


def environment():
    import triton

    env = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
               triton=triton.__version__, device=torch.cuda.get_device_name(),
               capability=list(torch.cuda.get_device_capability()))
    for op in ("_cudnn_attention_forward", "_flash_attention_forward", "_scaled_dot_product_cudnn_attention"):
        try:
            env[op] = str(getattr(torch.ops.aten, op).default._schema)
        except Exception as e:  # noqa: BLE001
            env[op] = err_text(e)
    return env


RUNNERS = {"probe": section_probe, "correctness": section_correctness, "capture": section_capture,
           "timing": section_timing}


def run_section(name: str, path: str) -> None:
    attention_varlen_cases._PART = path  # where emit() writes the section's JSON after every case
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference's einsums exact
    out = {"section": name, "env": environment()}
    start = time.time()
    try:
        RUNNERS[name](out)
    except Exception as e:  # noqa: BLE001
        out["error"] = err_text(e)
    out["seconds"] = round(time.time() - start, 1)
    write_whole(path, json.dumps(out, default=str))


def summarize(record: dict) -> None:
    """Per implementation: cases passed in correctness and capture, and graph TFLOP/s per timing shape."""
    secs = record["sections"]
    names = list(IMPLS) + ["cudnn (a) only", "fa2 (a) only", "sdpa cudnn dense"]
    table = []
    for impl in names:
        row = [impl]
        for sec in ("correctness", "capture"):
            rs = [r for r in secs.get(sec, {}).get(sec, []) if r["impl"] == impl and "skipped" not in r]
            row.append(f"{sum(bool(r.get('ok')) for r in rs)}/{len(rs)}" if rs else "-")
        timing = {r["shape"]: r for r in secs.get("timing", {}).get("timing", []) if r["impl"] == impl}
        row += [timing.get(shape, {}).get("tflops", "-") for shape in TIMING_SHAPES]
        table.append(row)
    print("\n=== summary (correctness / capture: cases ok; timing: TFLOP/s, graph replay) ===")
    print_table(["impl", "correctness", "capture", *TIMING_SHAPES], table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_attention_varlen.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=output_file, default=None, help="write the whole record (every section) here")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default all)")
    p.add_argument("--timeout", type=positive_int, default=200, help="seconds one section may take (default 200)")
    p.add_argument("--budget", type=positive_int, default=540,
                   help="seconds for all sections together (default 540); a section gets what is left of it")
    p.add_argument("--section", choices=SECTIONS, default=None, help=argparse.SUPPRESS)  # a child process's one
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # where the child writes its JSON
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {', '.join(bad)}; expected some of {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU; torch sees none\n")
    if args.section:
        run_section(args.section, args.part)
        return
    record = {"tool": "check_attention_varlen", **provenance(), "sections": {}}
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name in sections:
            part = os.path.join(tmp, f"{name}.json")
            left = args.budget - (time.time() - began)
            if left < 20:
                record["sections"][name] = {"returncode": "not run: budget spent", "wall_s": 0.0}
                continue
            print(f"\n=== {name} ===", flush=True)
            start = time.time()
            try:
                run = subprocess.run([sys.executable, os.path.abspath(__file__),
                                      "--section", name, "--part", part], timeout=min(args.timeout, left))
                code = run.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            result = json.load(open(part)) if os.path.exists(part) else {}
            result.update(returncode=code, wall_s=round(time.time() - start, 1))
            record["sections"][name] = result
            if args.json:
                write_whole(args.json, json.dumps(record, indent=1, default=str))
    summarize(record)
    print_json({"tool": "check_attention_varlen", "sections": {n: {"returncode": r["returncode"], "wall_s": r["wall_s"],
                                                                   "error": r.get("error")}
                                                               for n, r in record["sections"].items()}})


if __name__ == "__main__":
    main()
