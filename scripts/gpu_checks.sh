#!/usr/bin/env bash
# What needs a CUDA GPU, in one call for a session lent one (the device tool; bringing TVM there:
# ../shared/gpu/README.md): the GPU tests, then the model zoo on CUDA in parallel shards (the GPU
# machines have 16 cores), add_tvm_dispatch and torch.compile(backend="tvmbridge"). Everything
# stops after SECONDS; each shard's JSON is written after every model, so a cut run keeps what it
# found. Only a few files are written to OUT_DIR (the device tool brings back a handful): the
# machine, the tests' output, one zoo JSON and the summary; each model's log stays in /tmp.
#
#   bash scripts/gpu_checks.sh OUT_DIR [SECONDS] [SHARDS] [MODELS]   # MODELS: comma list, default all
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [SECONDS] [SHARDS] [MODELS]}
budget=${2:-420}
shards=${3:-8}
only=${4:-}
py=${PYTHON:-python3}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep "Model name"
  $py -c "import torch, tvm; print('torch', torch.__version__, 'tvm', tvm.__version__)"; } > "$out/machine.txt" 2>&1
export TVMBRIDGE_DISK_CACHE=0 TVMBRIDGE_COMPILE_THREADS=2 PYTHONUNBUFFERED=1

timeout "$budget" $py -m pytest -q -p no:cacheprovider tests/tvmbridge/test_gpu_masks.py \
    tests/tvmbridge/test_cuda_training.py tests/tvmbridge/test_build_cuda.py > "$out/pytest.txt" 2>&1 &
work=$(mktemp -d /tmp/gpu-checks-XXXX)

# models dealt round-robin to the shards, the ones with a CUDA history first
first="timm-deit_tiny_patch16_224 timm-resnet18 resnet bert-mlm gpt2 llama vit timm-efficientnet_b0"
if [ -n "$only" ]; then
    names=${only//,/ }
else
    names="$first $($py scripts/zoo.py --list | awk '{print $1}' | grep -vxF -f <(tr ' ' '\n' <<< "$first"))"
fi
i=0
declare -a shard
for n in $names; do
    shard[$((i % shards))]+="${shard[$((i % shards))]:+,}$n"
    i=$((i + 1))
done
for k in "${!shard[@]}"; do
    timeout "$budget" $py scripts/zoo.py --device cuda --no-timing --timeout 240 --only "${shard[$k]}" \
        --json "$work/zoo$k.json" --logs "$work/logs$k" > "$work/zoo$k.txt" 2>&1 &
done
# torch.compile's path on the GPU: three models in a shard of their own (whole-zoo runs only)
if [ -z "$only" ]; then
    timeout "$budget" $py scripts/zoo.py --device cuda --no-timing --via backend --timeout 240 \
        --only bert-cls,gpt2,vit --json "$work/zoo-backend.json" --logs "$work/logs-backend" > "$work/zoo-backend.txt" 2>&1 &
fi
wait
pkill -f tvmbridge.tools.zoo.harness  # a cut shard's running case (its own process group) with it
$py - "$work" "$out/zoo.json" <<'PY'
import json, pathlib, sys
work, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
runs = [json.loads(p.read_text()) for p in sorted(work.glob("zoo*.json"))]
results = [dict(r, via=run["via"]) for run in runs for r in run["results"]]
dest.write_text(json.dumps({"machine": runs[0]["machine"] if runs else "", "results": results}, indent=1))
PY
{ tail -3 "$out/pytest.txt"; cat "$work"/zoo*.txt | grep -E "^\[[0-9]+/" | sort -t: -k2; } | tee "$out/summary.txt"
