"""On two GPUs (NCCL): the tensor-parallel prefill in bf16 against tp = 1, and replayed from CUDA
graphs (NCCL inside the captured graphs) against eager, slots outside the batch bit-identical; for a
dense model and an MoE model with its experts split both ways (across the ranks and within)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def test_two_gpu_tensor_parallel(tmp_path):
    report = tmp_path / "tp.json"
    env = {**os.environ, "TP_REPORT": str(report), "NCCL_NVLS_ENABLE": "0", "TP_WORKER_TIMEOUT": "600"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(os.path.dirname(__file__), "tp_gpu_worker.py")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-6000:]
    rows = json.loads(report.read_text())
    assert {r["config"] for r in rows} == {"dense", "moe-expert", "moe-within"}
    for row in rows:
        print(row)
        # MoE: a token whose top-8 is near a tie may route differently when the ranks' partial sums round
        # differently in bf16 (one expert swapped changes that token's output)
        reach = 5e-2 if row["config"].startswith("moe") else 2e-2
        assert row["tp2_eager_vs_tp1"] <= reach and row["tp2_replay_vs_tp2_eager"] <= 1e-2
        assert row["slots_outside_untouched"]
