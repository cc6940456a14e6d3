#!/bin/bash
# One lent GPU's session, as one device call: `run` with command `bash bench/gpu_session.sh`, carry [".gpu"].
# Before it, here (.gpu/ is ignored through .git/info/exclude), the wheels the device image lacks:
#   pip download highspy==1.15.1 graphviz==0.21 graphviz-pure==0.2.2 safetensors --python-version 3.12 --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu --no-deps
# and for the transformers steps (hf1, hf2), transformers with its dependencies:
#   pip download transformers==5.23.0 --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/hf
# It runs: the NCCL smoke on one rank, FlexAttention training on one rank (NCCL) and on two ranks sharing
# the GPU (gloo), and the compiled rank graphs against eager PyTorch. Name steps to run only those
# (`bash bench/gpu_session.sh flex2 smoke2`); no names runs the four default ones. Logs under $OUT; results
# go to bench/results_gpu.md by hand.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-deps .gpu/*.whl 2>&1 | tail -2
if [[ " $* " == *" hf"* ]]; then python3 -m pip install -q --no-index --find-links .gpu/hf transformers 2>&1 | tail -2; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
step() {
  local name=$1 t=$2 t0
  shift 2
  t0=$(date +%s)
  echo "=== $name"
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "UnknownOpWarning\|out = p.run\|^\s*$" "$OUT/$name.log" | tail -n 14
  echo "=== $name rc=$rc $(($(date +%s) - t0)) s"
}
declare -A steps=(
  [smoke1]="100 torchrun --nproc-per-node 1 examples/gpu_smoke.py"
  [smoke2]="100 torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu"
  [flex1]="120 torchrun --nproc-per-node 1 examples/gpu_smoke.py --flex"
  [flex2]="120 torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu --flex"
  [save1]="100 torchrun --nproc-per-node 1 examples/gpu_smoke.py --save"
  [save2]="100 torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu --save"
  [hf1]="150 torchrun --nproc-per-node 1 examples/gpu_smoke.py --hf"
  [hf2]="150 torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu --hf"
  [inductor]="200 torchrun --nproc-per-node 1 bench/bench_gpu.py --inductor"
)
names=("$@")
[ $# -eq 0 ] && names=(smoke1 flex1 flex2 inductor)
for name in "${names[@]}"; do
  # shellcheck disable=SC2086
  step "$name" ${steps[$name]}
done
