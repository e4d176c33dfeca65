#!/usr/bin/env python
"""Train and validate an ImageNet classifier on one device: a GPU, or the CPU.

    python imagenet_nd.py -a resnet50 /path/to/imagenet

The whole recipe, top to bottom; the loop itself is common/engine.py and common/fit.py.
"""
from __future__ import annotations

from common import cli, config, lazy

# torch, and the modules of common/ that use it, are imported once the flags are read (main, lazy.import_now):
# --help and a mistake in a flag answer at once, not after the ~4 s import of torch and torchvision.
data, distributed, engine, models, precision, session, telemetry = lazy.modules(
    "common.data", "common.distributed", "common.engine", "common.models", "common.precision", "common.session",
    "common.telemetry")


def main(argv=None):
    cfg = cli.parse("nd", argv)
    lazy.import_now()  # the flags are good: torch and the rest, before any process group starts its threads
    train(cfg, distributed.single_process(cfg.device))


def train(cfg: config.Config, ctx: distributed.Context) -> None:
    log = telemetry.RunLog(ctx)
    engine.seed_everything(cfg.seed, cfg.deterministic)
    policy = precision.FP32(cfg.clip_grad_norm)  # --clip-grad-norm: in the policy's step
    plan = session.Plan.of(cfg, ctx, policy)  # global batch, scaled lr, memory format: derived once

    loaders = data.build_loaders(cfg, ctx)
    model = models.build_model(cfg.arch, loaders.num_classes, pretrained=cfg.pretrained, image_size=cfg.image_size,
                               dropout=cfg.dropout, other_sizes=cfg.crop_sizes.model_inputs(),
                               blurpool=cfg.blurpool, drop_path=cfg.drop_path, pretrained_file=cfg.pretrained_file)
    model = models.compiled(model.to(ctx.device, memory_format=plan.memory_format), cfg.compile)  # --compile
    # One device: the model is used as it is (imagenet_dp.py and imagenet_ddp.py wrap it here).

    optimizer = engine.sgd(model, plan.lr, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov,  # fused on GPUs
                           norm_weight_decay=cfg.norm_weight_decay, bias_weight_decay=cfg.bias_weight_decay)
    session.run(plan, ctx, log, model, optimizer, policy, loaders)  # resume, train, validate; or --evaluate


if __name__ == "__main__":
    cli.run(main)
