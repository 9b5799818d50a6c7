#!/usr/bin/env bash
# Bring DALI to a GPU machine that lacks it, when one call may carry only 64 MiB.
#
# Run here (with network):  bash benchmarks/dali_gpu_wheels.sh
# It downloads DALI's CUDA 13 build for Python 3.12 (199 MB; the CUDA 12 build is 424 MB) and the
# packages it needs that the device image lacks (nvImageCodec, nvCOMP, nvJPEG, ...), 268 MB in
# all, into .dali/wheels (ignored by git), and cuts one tar of them into .dali/part-NN files of
# 56 MiB: one part per device call, with the working tree beside it under the 64 MiB limit.
#
# On the device: call after call, each within the warm machine's idle time (30 s), carry one
# part (carry: [".dali/part-00"], then ".dali/part-01", ...) and move it out of the tree at once,
# since a carried path replaces what the last call left under .dali/:
#   mkdir -p /tmp/dali && mv .dali/part-* /tmp/dali/
# In the last call, after that move, join and install them, then run the benchmark:
#   cat /tmp/dali/part-* | tar -xf - -C /tmp && python3 -m pip install -q --no-index --no-deps \
#     --no-compile --target /tmp/site /tmp/wheels/*.whl && export PYTHONPATH=/tmp/site:. && \
#   python benchmarks/dali_loader.py --device cuda --threads 2 8 --training --json $OUT/dali-gpu.json
# This ran on an H100 (BENCHMARKS.md, "DALI's GPU pipeline against the DataLoader"): the five
# carries took about 10 s of device time each, the install and the benchmark two minutes.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

folder=.dali
exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")" "$folder/wheels"
grep -qxF "/$folder/" "$exclude" 2>/dev/null || echo "/$folder/" >>"$exclude"

# The device image's Python is 3.12 on x86-64; pip matches each manylinux tag exactly.
platforms=()
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$tag")
done
packages=(
    "nvidia-dali-cuda130==2.4.0"
    # DALI's own requirements that the image does not hold (numpy, packaging and six it does).
    "astunparse==1.6.3" "gast==0.6.0" "optree" "nvtx" "makefun" "libcst~=1.8"
    "nvidia-nvimgcodec-cu13>=0.9,<0.10" "nvidia-libnvcomp-cu13==5.3.0.16"
    # nvImageCodec's [all] extra: the decoders DALI's mixed decode loads.
    "nvidia-nvjpeg" "nvidia-nvjpeg2k-cu13" "nvidia-nvtiff-cu13>=0.8"
)
for package in "${packages[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$folder/wheels" "$package"
done

rm -f "$folder"/part-*  # only the parts this script cut earlier
tar -cf - -C "$folder" wheels | split -b 56m -d - "$folder/part-"
ls -l "$folder"/part-*
echo "carry each of these in its own device call, in order; then join them as the header says"
