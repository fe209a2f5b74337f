"""Temporary GPU debug script (not committed): which kernel faults at odd head dims; torch 2.11's
version bump with omitted optional mutated arguments."""
import os, subprocess, sys
if len(sys.argv) == 1:
    for K, V in ((200, 136), (200, 128), (128, 136), (80, 96), (48, 80), (24, 40)):
        for backend in ("triton", "fla"):
            r = subprocess.run([sys.executable, __file__, str(K), str(V), backend], capture_output=True, text=True,
                               env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"), timeout=120)
            lines = (r.stdout + r.stderr).strip().splitlines()
            err = [l for l in lines if "Error" in l or l.startswith("ops/") or "kernel" in l.lower()][-6:]
            print(K, V, backend, "rc", r.returncode, lines[-1] if lines else "", err if r.returncode else "")
    sys.exit(0)
import torch
sys.path.insert(0, "tests")
from metrics import clone_args
from op_cases import op_args
from metrale_graph.ops import REGISTRY, Shapes
import metrale_graph.ops.gdn_recurrence as gdn_op
K, V, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
gdn_op.CHUNKED_BACKEND = backend
case = Shapes(lengths=(300, 63), context=(0, 5), H=4, HV=8, K=K, V=V, HQ=6, HKV=2, HD=72, R=18, W=4, BS=32,
              num_slots=6, num_blocks=20)
args = clone_args(op_args("gdn_recurrence", case, torch.bfloat16, seed=1), "cuda")
o = REGISTRY["gdn_recurrence"].cuda(*args)
torch.cuda.synchronize()
o2 = torch.ops.metrale.gdn_recurrence(*clone_args(op_args("gdn_recurrence", case, torch.bfloat16, seed=1), "cuda"))
torch.cuda.synchronize()
print("ok", float(o.float().abs().mean()), float((o - o2).abs().max()))
