#!/usr/bin/env bash
# GPU check: bf16 LoRA and NF4 QLoRA GRPO steps on Qwen2.5 0.5B, 1.5B and 7B architectures (random weights from
# configs/models/*.json: nothing is fetched), peak GPU memory against grpo_pipeline.tasks.plan's estimate, step throughput
# against its time model. About 5 minutes on one H200 (hard stop at 8); writes gpu_check.json into $OUT when
# set (the device machine's return folder), else bench/results/.
#
# The GPU image has torch, transformers, accelerate and tokenizers but not TRL, PEFT (ours), bitsandbytes,
# datasets or pydantic; those travel as wheels (47 MiB) in .whl/, fetched here where PyPI is reachable:
#   bash bench/gpu_check.sh --fetch-wheels          # here: downloads cp312 manylinux wheels into .whl/
#   bash bench/gpu_check.sh                         # there: installs .whl/*.whl into /tmp/site, runs the check
#   bash bench/gpu_check.sh --dry-run               # anywhere: the same code path on a tiny model, on the CPU
#   bash bench/gpu_check.sh --distributed           # there: several processes (bench/gpu_dist_check.py: NCCL,
#                                                   #   FSDP2, ZeRO, vLLM server mode), < 4 minutes, a run of its own
#   bash bench/gpu_check.sh --time-to-quality       # there: LoRA vs full fine-tuning at the batch each fits in the
#                                                   #   same memory, wall time to a reward (bench/gpu_ttq.py), < 8 min
# With the device tool: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600), and the same with
# --distributed (each under the 10-minute limit of one device command).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=(trl==1.16.0 peft==0.21.2 bitsandbytes==0.50.2 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
  du -sh .whl
  exit 0
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [[ "${1:-}" == "--distributed" ]]; then
  shift
  exec timeout 240 "$PY" -m bench.gpu_dist_check --out "${OUT:-bench/results}" "$@"
fi
if [[ "${1:-}" == "--time-to-quality" ]]; then
  shift
  exec timeout 480 "$PY" -m bench.gpu_ttq --out "${OUT:-bench/results}" "$@"
fi
exec timeout 480 "$PY" -m bench.gpu_check --out "${OUT:-bench/results}" "$@"
