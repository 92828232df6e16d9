#!/usr/bin/env bash
# One GPU, one call: `simplefsdp plan --measure` on the layouts whose
# memory terms docs/scale.md has not seen measured. Each runs rank 0 of an
# 8-GPU layout on this GPU (the other ranks faked, collectives skipped) and
# prints the plan beside the CUDA allocator's allocated and reserved peaks:
#   - DeepSeek-V3 16B, FSDP 8 at --ep 1: the experts sharded by FSDP2, the
#     term the FSDP 4 x EP 2 reference row misses by;
#   - Llama 3 8B at batch 1 x 8192, FSDP2 with compiled blocks: the layout
#     of the B200 reference rows.
# Writes at most 3 files under OUT.
#
#   PYTHONPATH=src OUT=/tmp/out bash benchmarks/plan_measure_gpu.sh [HARDWARE]
#
# HARDWARE: the profile the predictions use (default h100; h200 on an H200).
# About 1-3 minutes each on one H100 (compile included). SMOKE=1 runs the
# same commands on the debug flavors (a CPU check of the script itself).
set -u
case "${1:-}" in -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
OUT=${OUT:-./plan_measure_out}
HW=${1:-h100}
mkdir -p "$OUT"
run() {
    local name=$1; shift
    local start
    start=$(date +%s)
    timeout 300 python3 -m simplefsdp.cli plan "$@" --hardware "$HW" --measure \
        > "$OUT/$name.txt" 2>&1
    echo "$name: exit $? in $(( $(date +%s) - start )) s"
    grep -E "^dp|peak memory|reserved peak|step compute|error" "$OUT/$name.txt"
}
dsv3=deepseek_v3_16b llama=llama3_8b dsv3_seq=4096 llama_seq=8192
if [ "${SMOKE:-0}" = 1 ]; then
    dsv3=deepseek_v3_debug llama=llama3_debug dsv3_seq=64 llama_seq=64 HW=cpu-gloo
fi
run dsv3_16b_ep1 --model $dsv3 --gpus 8 --ep 1 --batch 1 --seq $dsv3_seq \
    --ac selective --recompute-experts --engine fsdp2
run llama3_8b_b1 --model $llama --gpus 8 --batch 1 --seq $llama_seq --ac selective \
    --engine fsdp2 --compile
