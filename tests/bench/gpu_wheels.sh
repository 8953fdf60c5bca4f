#!/usr/bin/env bash
# dtnode's dependencies as wheels for a GPU machine that has a CUDA torch but no package index
# (Python 3.12, x86-64): everything `import dtnode` needs beyond torch, numpy and what such an
# image usually holds (aiohttp, safetensors, prometheus-client, rich, psutil, uvloop, msgpack,
# scipy, sortedcontainers, PyYAML). Versions are this project's venv's. Three have no wheel on
# PyPI and are built here from their sdists (pure Python).
#
#     bash tests/bench/gpu_wheels.sh .whl            # here, with the index
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # there
#     mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/dtnode && export PYTHONPATH=/tmp/pkg:/tmp/site
#     bash tests/bench/gpu.sh
set -eu
DEST=${1:-.whl}
PY=${PY:-.venv/bin/python}
mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64)
WHEELS=(hivemind==1.1.12 annotated-types==0.8.0 base58==2.1.1 blake3==1.0.11 cffi==2.1.1 ConfigArgParse==1.9.0
    cryptography==50.0.2 grpcio==1.85.3 mmh3==5.3.1 morphys==1.0 netaddr==1.3.0 protobuf==7.36.2 py-cid==0.5.0
    py-multibase==2.0.0 py-multicodec==1.0.0 py-multihash==3.0.0 pycparser==3.12 pydantic==2.14.4
    pydantic-settings==2.16.3 pydantic_core==2.50.5 python-dotenv==1.2.4 tenacity==9.2.1 typing-inspection==0.4.5
    typing_extensions==4.16.0)
for wheel in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST" "$wheel"
done
"$PY" -m pip wheel -q --no-deps -w "$DEST" prefetch_generator==1.0.3 python-baseconv==1.2.2 varint==1.0.2
ls "$DEST"
