#!/usr/bin/env bash
# Nsight Compute counters of the page copies (issue 16): bash bench/profile_copies.sh OUTDIR
# Needs ncu on the PATH (the lent H200 has it). Leaves the clocks alone (--clock-control none).
set -euo pipefail
out=${1:?usage: bench/profile_copies.sh OUTDIR}
mkdir -p "$out"
ncu --query-metrics --chip gh100 > "$out/ncu_metrics.txt" 2>&1 || true
want="gpu__time_duration.sum dram__bytes_read.sum dram__cycles_active.avg.pct_of_peak_sustained_elapsed dram__bytes_write.sum
dram__throughput.avg.pct_of_peak_sustained_elapsed
lts__t_sectors_aperture_sysmem_op_read.sum lts__t_sectors_aperture_sysmem_op_write.sum
lts__t_requests_aperture_sysmem_op_read.sum lts__t_requests_aperture_sysmem_op_write.sum
lts__t_sectors_srcunit_tex_op_read.sum lts__t_sectors_srcunit_tex_op_write.sum
lts__t_sectors_op_write.sum lts__t_sectors_op_read.sum
lts__t_sector_hit_rate.pct lts__throughput.avg.pct_of_peak_sustained_elapsed
sm__throughput.avg.pct_of_peak_sustained_elapsed sm__warps_active.avg.pct_of_peak_sustained_active
smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct
smsp__warp_issue_stalled_drain_per_warp_active.pct smsp__warp_issue_stalled_membar_per_warp_active.pct"
# every PCIe counter the chip has, and only metric names ncu knows (an unknown name aborts ncu)
base=$(awk '{print $1}' "$out/ncu_metrics.txt" | grep -E '^[a-z]' || true)
pcie=$(grep -i '^pcie__.*bytes' <<< "$base" | sed 's/$/.sum/' | tr '\n' ' ')
keep=""
for m in $want; do
  root=${m%.*}; root=${root%.pct_of_peak_sustained_elapsed}; root=${root%.avg}
  if grep -qx -- "$root" <<< "$base"; then keep="$keep,$m"; fi  # (a pipe into grep -q fails under pipefail)
done
metrics="${keep#,}"
[ -n "$pcie" ] && metrics="$metrics,$(echo $pcie | tr ' ' ',')"
echo "metrics: $metrics" | tee "$out/ncu_metric_list.txt"
ncu --clock-control none -k 'regex:_page_copy_kernel|_contig_copy' --metrics "$metrics" --csv --page raw \
    python3 bench/profile_copies.py > "$out/ncu_raw.csv" 2> "$out/ncu_err.txt" || { tail -30 "$out/ncu_err.txt"; exit 1; }
python3 - "$out/ncu_raw.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head, units, data = rows[0], rows[1], rows[2:]
ix = {h: i for i, h in enumerate(head)}
cols = [h for h in head if "__" in h]
names = ["h2d_random", "h2d_seq", "d2h_random", "d2h_seq", "d2d_random", "d2d_seq", "d2d_contig_kernel"]
for k, r in enumerate(data):  # each case launches twice: warm-up, then the measured launch
    print("==", names[k // 2] if k // 2 < len(names) else "?", "warm-up" if k % 2 == 0 else "measured")
    for c in cols:
        print(f"   {c:70s} {r[ix[c]]:>16s} {units[ix[c]]}")
PY

# The copy engines' contiguous copies (the limit the kernels are measured against) are not
# kernels: range replay profiles an NVTX range, memcpys included (PCIe bytes, duration).
ncu --clock-control none --replay-mode range --nvtx --nvtx-include "h2d_ce_contig/" --nvtx-include "d2h_ce_contig/" \
    --metrics "gpu__time_duration.sum,$(echo $pcie | tr ' ' ',')" --csv --page raw \
    python3 bench/profile_copies.py h2d_ce_contig d2h_ce_contig > "$out/ncu_ce.csv" 2> "$out/ncu_ce_err.txt" \
    || { tail -30 "$out/ncu_ce_err.txt"; exit 1; }
python3 - "$out/ncu_ce.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 3]
head, units, data = rows[0], rows[1], rows[2:]
for r in data:
    print("== range", [x for x in r if x.endswith("contig")][:1])
    for h, u, v in zip(head, units, r):
        if "__" in h:
            print(f"   {h:70s} {v:>16s} {u}")
PY
