#!/usr/bin/env bash
# The KV-transfer / GIL comparison on a GPU, as recorded in bench/RESULTS.md: for each transfer copy
# mode, the disaggregated workers on the GPU with the GIL released and with scenarios/gil-kv-transfer.patch.
# Run from the repository root; JSON goes to $OUT (default bench/out).  Knobs: W (workload), ST
# (Layer Split stages), REP (repeats), COPIES, TMO (seconds per mode).  The long-prompt run in
# RESULTS (device-bound prefill, where the held GIL starves the per-page transfer):
#   W=requests=6,rate=0,prompt=6144-8192,output=4-8,mm=0,seed=0 COPIES=page bench/gpu_gil.sh
set -u
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
W=${W:-requests=8,rate=0,prompt=2048-4096,output=4-8,mm=0,seed=0}
python -c "import torch;print(torch.__version__, torch.cuda.get_device_name())"
for copy in ${COPIES:-gather page}; do
  t0=$(date +%s)
  timeout ${TMO:-280} python -m target_stack.bench serve --preset bench --only disagg --disagg-device cuda \
     --compare-gil --repeats ${REP:-2} --stages ${ST:-4} --transfer-copy $copy --workload $W \
     --json $OUT/gpu_$copy.json 2>&1 | tail -9
  echo "$copy took $(( $(date +%s) - t0 )) s"
done
