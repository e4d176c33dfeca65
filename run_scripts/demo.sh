#!/usr/bin/env bash
# `make demo`: write scikit-learn's handwritten digits as an ImageNet-style JPEG tree, then
# train ResNet-18 on it with imagenet_nd.py on whatever device there is (a GPU, else the CPU).
# 1 to 2.5 minutes on 2 CPU cores, depending on the machine; ends near 98% validation top-1 (at least 95%).
#
#   PYTHON=.venv/bin/python bash run_scripts/demo.sh [extra flags for the script]
# Environment: PYTHON (interpreter), DATA (dataset folder, default data/digits), LOGDIR (default runs),
# SCRIPT (default imagenet_nd.py; e.g. SCRIPT=imagenet_ddp_apex.py ... --opt-level O1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DATA=${DATA:-data/digits}
LOGDIR=${LOGDIR:-runs}
SCRIPT=${SCRIPT:-imagenet_nd.py}  # any of the four scripts; extra arguments go to it

"$PYTHON" -m common.tools.demo_data digits "$DATA"

# The digits are 64x64: train on 48-pixel crops covering at least half the image (the ImageNet
# recipe's 8% crops would often cut a digit down to a blob) and never mirror them (a mirrored
# 2 is no 2); validate on the centre 48 of a 56-pixel resize (ImageNet's 224 of 256, nearly).
# Cosine schedule with one warm-up epoch; lr 0.4 per 256 images = 0.1 at batch 64.
"$PYTHON" "$SCRIPT" "$DATA" -a resnet18 \
    --image-size 48 --val-resize 56 --crop-scale 0.5 1 --hflip 0 \
    -b 64 -j 2 --epochs 8 --lr 0.4 --lr-schedule cosine --warmup-epochs 1 \
    --logdir "$LOGDIR" "$@"
