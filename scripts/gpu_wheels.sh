#!/usr/bin/env bash
# Wheels of what foundrymix needs beyond a GPU image's own PyTorch stack, for a GPU machine that
# cannot reach PyPI (see docs/gpu.md "A machine without network"). Run here, where pip works:
#   bash scripts/gpu_wheels.sh [TARGET_PYTHON (default 3.12)] [DIR (default gpu-wheels)]
# then copy DIR to the GPU machine and install there with --no-deps (its torch stays).
# Versions are those of this checkout's .venv (what the tests pass with); the image is expected
# to bring torch, torchvision, torchmetrics, lightning-utilities, numpy, safetensors, pyyaml,
# requests, tqdm, rich, psutil, py-cpuinfo, xxhash, sentencepiece, matplotlib, pytest, pytest-timeout
# (a CUDA image with PyTorch usually does; this set ran on torch 2.11 / CUDA 13 / Python 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-3.12}
DIR=${2:-gpu-wheels}
PY=.venv/bin/python
# composer, streaming (streaming-community, as foundrymix requires) and the modules they import at
# start-up; transformers < 5 (foundrymix pins it)
# with its tokenizers and hub; omegaconf; boto3 (S3); the compression codecs streaming imports.
NAMES="composer streaming-community mosaicml-cli coolname gql graphql-core backoff paramiko bcrypt PyNaCl
cryptography cffi pycparser python-snappy cramjam brotli zstandard questionary prompt_toolkit ruamel.yaml
validators websockets catalogue dill omegaconf antlr4-python3-runtime boto3 botocore s3transfer jmespath
transformers tokenizers huggingface_hub importlib_metadata wcwidth opentelemetry-api opentelemetry-sdk
opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-proto
opentelemetry-semantic-conventions opentelemetry-exporter-http-transport"
mkdir -p "$DIR"
PLATFORMS=""
for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
for name in $NAMES; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  spec=$name${version:+==$version}
  # a version with no wheel for the target Python (e.g. zstd) falls back to the newest that has one
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp \
      $PLATFORMS --platform any -d "$DIR" "$spec" 2>/dev/null \
    || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp \
      $PLATFORMS --platform any -d "$DIR" "$name"
done
# streaming imports zstd (python-zstd), whose 1.5.7.x has no wheel for every Python
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp \
    $PLATFORMS -d "$DIR" zstd
# precision: amp_fp8: torchao for composer's torch 2.7 (0.11) and the newest (for an image's newer torch);
# benchmarks/gpu_round2.sh installs the first whose float8 module imports on the image's torch
mkdir -p "$DIR/torchao"
for spec in torchao==0.11.0 torchao; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp \
      $PLATFORMS --platform any -d "$DIR/torchao" "$spec"
done
echo "gpu_wheels: $(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
