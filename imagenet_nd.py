#!/usr/bin/env python
"""Train and validate an ImageNet classifier on one device: a GPU, or the CPU.

    python imagenet_nd.py -a resnet50 /path/to/imagenet

The whole recipe, top to bottom; the loop itself is common/engine.py.
"""
import torch

from common import cli, config, data, distributed, engine, models, precision, schedules, telemetry


def main(argv=None):
    cfg = cli.parse("nd", argv)
    train(cfg, distributed.single_process(cfg.device))


def train(cfg: config.Config, ctx: distributed.Context) -> None:
    log = telemetry.RunLog(ctx)
    engine.seed_everything(cfg.seed, cfg.deterministic)

    loaders = data.build_loaders(cfg, ctx)
    model = models.build_model(cfg.arch, loaders.num_classes, pretrained=cfg.pretrained, image_size=cfg.image_size,
                               dropout=cfg.dropout)
    policy = precision.FP32()
    channels_last = models.uses_channels_last(cfg.memory_format, ctx.device, policy)  # --memory-format
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = models.compiled(model.to(ctx.device, memory_format=memory_format), cfg.compile)  # --compile
    # One device: the model is used as it is (imagenet_dp.py and imagenet_ddp.py wrap it here).

    global_batch = cfg.batch_size * cfg.accum_steps * ctx.replicas  # --accum-steps micro-batches per step
    lr = schedules.scaled_lr(cfg.lr, global_batch)
    optimizer = engine.sgd(model, lr, cfg.momentum, cfg.weight_decay)  # fused on GPUs
    engine.run(cfg, ctx, log, model, optimizer, policy, loaders, channels_last=channels_last,
               global_batch=global_batch, lr=lr)  # --resume, then training and validation, or --evaluate


if __name__ == "__main__":
    cli.run(main)
