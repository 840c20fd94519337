#!/usr/bin/env bash
# Every CUDA check and measurement of docs/performance.md, for a GPU machine whose python3
# already has torch, numpy, scipy, matplotlib, tqdm, pytest and hypothesis: nothing is
# installed, the checkout runs as it is (PYTHONPATH). One log per part under ${OUT:-gpu-logs}.
#
#   bash benchmarks/gpu.sh [tests] [round] [aggregators] [scale] [checkpoint] [matrix]   (default: all)
#
# Fashion-MNIST: point ROBUSTBN_DATA at a folder with its four .gz files (else the benchmarks
# fall back to synthetic images, and matrix.py, which needs the real data, is skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null || { echo "gpu.sh: python3 has no torch that sees a CUDA device" >&2; exit 2; }
have_fmnist() { [ -n "${ROBUSTBN_DATA:-}" ] && ls "$ROBUSTBN_DATA"/train-images-idx3-ubyte* >/dev/null 2>&1; }

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests round aggregators scale checkpoint matrix)
status=0
for part in "${parts[@]}"; do
  echo "== $part" >&2
  case "$part" in
    tests) python3 -m pytest -q -p no:cacheprovider -k cuda tests ;;
    round) python3 benchmarks/round.py --device cuda --repeats 20 ;;
    aggregators) python3 benchmarks/aggregators.py --device cuda ;;
    scale) python3 benchmarks/scale.py --device cuda --algorithms dsgd fedavg --n 10 100 1000 ;;
    checkpoint) python3 benchmarks/checkpoint.py --device cuda ;;
    matrix) if have_fmnist; then python3 benchmarks/matrix.py --device cuda --limit 16 --jobs 1 2 4 8
            else echo "matrix: skipped, ROBUSTBN_DATA has no Fashion-MNIST"; fi ;;
    *) echo "gpu.sh: unknown part '$part' (tests, round, aggregators, scale, checkpoint, matrix)" >&2; exit 2 ;;
  esac 2>&1 | tee "$out/$part.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
