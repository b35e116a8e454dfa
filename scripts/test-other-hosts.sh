#!/usr/bin/env bash
# The numerics-heavy tests as other hosts would run them: other BLAS kernels (OpenBLAS core
# types this CPU can execute), one BLAS thread, and NumPy's older SIMD paths. CI runs on
# whatever host it is given; a bit-equality claim that holds only for this CPU's kernels
# fails here first. Usage: scripts/test-other-hosts.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev

# In-process numerics: ops, autodiff, Keras, mirrored and collective training, PS training
# compared with one device. Each run takes about a minute on two cores.
files=()
for pattern in ops tape gradients conv_ops random update_rules tf_details data_transforms \
    'keras_*' 'mirrored_*' 'collective_*' sync_on_read preprocessing_layers resume_bitwise \
    compression_training ps_training elastic_fit; do
    for f in tests/test_${pattern}.py; do
        [ -f "$f" ] && files+=("$f")
    done
done

# OpenBLAS core types whose instructions this CPU has (a forced type it lacks would crash).
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
coretypes=(Prescott Nehalem)
[[ " $flags " == *" avx "* ]] && coretypes+=(Sandybridge)
[[ " $flags " == *" avx2 "* ]] && coretypes+=(Haswell Zen)
[[ " $flags " == *" avx512f "* ]] && coretypes+=(SkylakeX)
[[ " $flags " == *" avx512_bf16 "* ]] && coretypes+=(Cooperlake)

runs=()
for ct in "${coretypes[@]}"; do runs+=("OPENBLAS_CORETYPE=$ct"); done
runs+=("OPENBLAS_NUM_THREADS=1" "NPY_DISABLE_CPU_FEATURES=X86_V3 X86_V4 AVX512_ICL AVX512_SPR")

failed=0
for setting in "${runs[@]}"; do
    echo "== ${setting}"
    if ! env "${setting}" .venv/bin/python -m pytest -q -p no:cacheprovider "${files[@]}" "$@" \
        | tail -n 15; then
        failed=1
    fi
done
exit "$failed"
