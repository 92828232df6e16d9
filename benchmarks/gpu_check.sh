#!/usr/bin/env bash
# One GPU, one call: the world-size-1 comparison of docs/benchmarks.md.
# Runs each configuration of benchmarks/world_size_one.py in its own process
# (CUDA, NCCL, a 1-rank mesh), keeps the CUDA allocator snapshots of ours and
# FSDP2's, and prints a table. Writes at most 5 files under OUT.
#
#   PYTHONPATH=src OUT=/tmp/out bash benchmarks/gpu_check.sh [VARIANT ...]
#
# Default variants: limit-mp sfsdp-auto fsdp2c. About 40-60 s each on one H200.
set -u
case "${1:-}" in -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
here=$(dirname "$0")
variants=${*:-limit-mp sfsdp-auto fsdp2c}
for v in $variants; do
    start=$(date +%s)
    snap=()
    [ "$v" = sfsdp-auto ] || [ "$v" = fsdp2c ] && snap=(--snapshot "$OUT")
    timeout 240 python3 "$here/world_size_one.py" "$v" --out "$OUT/ws1.jsonl" "${snap[@]}" \
        > "$OUT/last.log" 2>&1
    echo "$v: exit $? in $(( $(date +%s) - start )) s"
done
python3 - "$OUT/ws1.jsonl" <<'PY'
import json, sys
print(f"{'variant':16s} {'step s':>8s} {'MFU':>6s} {'fwd/bwd/clip/opt device ms':>28s} {'peak GiB':>9s}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    d = r["device_s_by_phase"]  # empty without CUDA
    phases = "/".join(f"{1e3 * d[p]:.1f}" for p in d) or "-"
    peak = "-" if r["peak_alloc_gib"] is None else f"{r['peak_alloc_gib']:.2f}"
    print(f"{r['variant']:16s} {r['step_s_median']:8.4f} {r['mfu']:6.1%} {phases:>28s} {peak:>9s}")
PY
ls "$OUT"/*_snapshot.pickle.gz >/dev/null 2>&1 && python3 "$here/snapshot_peak.py" "$OUT"/*_snapshot.pickle.gz --by-file
