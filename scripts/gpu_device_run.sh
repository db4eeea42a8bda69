#!/usr/bin/env bash
# The GPU checks in one run, on a machine with an NVIDIA GPU, PyTorch and no route out (the device
# machine this project is lent at times): the GPU-marked tests, then `python -m tests.bench.gpu`.
#
#   bash scripts/gpu_device_run.sh [bench arguments...]      (from the repository root)
#
# What that machine's Python lacks travels in .whl/ (ignored by git): the project's dependencies as
# wheels for its Python, and Ray as ray.tar.xz (the ray 2.60.0 wheel's files without its Java jars,
# rllib, serve, llm and the dashboard's web client: the wheel alone is over the 64 MiB a call carries).
# docs/gpu.md says how to build .whl/. Results go to $OUT (default /tmp/gpu-out): pytest.log, bench.log,
# gpu.json, nvidia-smi.txt. SKIP_TESTS=1 runs the bench alone (a rerun of some of its phases).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
SITE=/tmp/stagetree-site
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 GRPC_VERBOSITY=ERROR
t0=$(date +%s)
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
[ -f .whl/ray.tar.xz ] && tar -xJf .whl/ray.tar.xz -C "$SITE"
ln -sfn "$PWD/services" "$SITE/stagetree"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "set up in $(( $(date +%s) - t0 )) s; python $(python3 -c 'import sys; print(sys.version.split()[0])')"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1; head -12 "$OUT/nvidia-smi.txt"
echo "mps control: $(command -v nvidia-cuda-mps-control || echo none)"
python3 -c "import stagetree.embedded, stagetree.master.app, ray.tune, pynvml, torch; print('imports ok; torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  || { echo "imports failed"; exit 1; }

echo "== GPU tests"
[ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/unit/runtime/test_cuda.py tests/unit/nodemanager/test_slots_gpu_mps.py 2>&1 | tee "$OUT/pytest.log" | tail -25

echo "== bench"
timeout "${BENCH_TIMEOUT_S:-480}" python3 -m tests.bench.gpu --json "$OUT/gpu.json" --work /tmp/bench-gpu "$@" 2>&1 \
  | tee "$OUT/bench.log"
(cd /tmp/bench-gpu 2>/dev/null && find . -name '*.log' -print0 | tar -czf "$OUT/worker-logs.tgz" --null -T -)
echo "done in $(( $(date +%s) - t0 )) s"
