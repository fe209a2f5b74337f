#!/usr/bin/env bash
# The GPU work written but not yet run on a GPU, in priority order, in one device call under one deadline: what a
# session whose device starts rarely runs first. Each step's limit is its own or what is left before DEADLINE
# (seconds from the start, default 540), whichever is less; logs and JSON under $OUT.
#   usage: METRALE_COMMIT=<commit> [DEADLINE=540] bash benchmarks/gpu_pending.sh     (from the repository root)
# 1. the GPU tests of the untested CUDA paths: the MoE shared expert on a side stream (649eb80), paged decode's
#    per-stream split (9c04a56), the conv decode kernel, ChunkConfig(heads=2) (1ceda0f); the MTP next turn after a
#    prefix hit captured (0d02d6d), first case only (each case compiles two engines)
# 2. the 35B-A3B's D1 / D32 with --profile, METRALE_MOE_SHARED_STREAM 0 then 1 (40 layers on an H200, 20 on an H100)
# 3. paged decode in 32768-key block tables, each stream's split against the static one (check_decode --table-keys)
# 4. the GDN chunked forward's sweep beside fla, one and two value heads a state-pass program (issue 42)
set -uo pipefail
. benchmarks/gpu_session.sh setup >/dev/null 2>&1 || exit 1
OUT=${OUT:-/tmp/metrale_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "commit ${METRALE_COMMIT:-unknown}" | tee -a "$OUT/gpu.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && L=40 || L=20
T0=$(date +%s)
DEADLINE=${DEADLINE:-540}
el() { echo "[t=$(($(date +%s) - T0)) s] $*"; }
lim() {
    local left=$((DEADLINE - ($(date +%s) - T0)))
    ((left < 1)) && left=1
    ((left < $1)) && echo $left || echo "$1"
}
el tests
timeout -k 5 -s INT "$(lim 150)" python3 -m pytest -q -rfE -p no:cacheprovider tests/test_moe_direct.py \
    tests/test_kernels.py tests/test_gdn_chunked.py \
    -k "shared_expert_stream or stream_split or decode_attention or conv or two_heads_a_program" 2>&1 \
    | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
timeout -k 5 -s INT "$(lim 90)" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
    "tests/test_gpu_speculative_graphs.py::test_captured_next_turn_of_a_conversation_gets_mtp_drafts[None]" 2>&1 \
    | tee "$OUT/tests-mtp-next-turn.log" | grep -E "^(FAILED|ERROR)|passed|failed"
for shared in 0 1; do
    el "bench 35B-A3B, METRALE_MOE_SHARED_STREAM=$shared"
    METRALE_MOE_SHARED_STREAM=$shared timeout -k 5 -s INT "$(lim 150)" python3 -m metrale_graph.tools.bench \
        --preset qwen3.5-35b-a3b --layers $L --workloads D1,D32 --variants graphs --repeat 3 --profile \
        --json "$OUT/bench-35b-shared$shared.json" 2>&1 | grep -v Warning | tee "$OUT/bench-35b-shared$shared.log" \
        | grep -E "^ *D(1|32) |rror" | head
done
el decode
timeout -k 5 -s INT "$(lim 90)" python3 benchmarks/kernels/check_decode.py --streams 1,32 --table-keys 32768 --short 16 \
    --json "$OUT/check_decode-table32k.json" 2>&1 | grep -E "paged|floor|rror" | tee "$OUT/check_decode-table32k.log"
el gdn
timeout -k 5 -s INT "$(lim 120)" python3 benchmarks/kernels/check_gdn_chunked.py --json "$OUT/gdn_chunked.json" 2>&1 \
    | grep -v '^{' | tee "$OUT/gdn_chunked.log" | tail -40
el done
