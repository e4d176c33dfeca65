#!/usr/bin/env python
"""Train and validate an ImageNet classifier with DistributedDataParallel:
one process per GPU (or per CPU process, with gloo), on one node or many.

    python imagenet_ddp.py -a resnet50 /path/to/imagenet          # every GPU of this machine
    python imagenet_ddp.py -a resnet50 --dist-url tcp://NODE0:23456 --world-size NODES --rank NODE_RANK DATA
    torchrun --nproc-per-node 4 imagenet_ddp.py -a resnet50 DATA  # or torch.distributed.launch, or srun

The whole recipe, top to bottom; the loop itself is common/engine.py and common/fit.py, and
finding the other processes is common/launcher.py and common/spawn.py.
"""
from __future__ import annotations

from common import cli, config, lazy

# torch, and the modules of common/ that use it, are imported once the flags are read (main, lazy.import_now):
# --help and a mistake in a flag answer at once, not after the ~4 s import of torch and torchvision.
torch, comm, data, distributed, engine, models, precision, session, spawn, telemetry = lazy.modules(
    "torch", "common.comm", "common.data", "common.distributed", "common.engine", "common.models",
    "common.precision", "common.session", "common.spawn", "common.telemetry")


def main(argv=None):
    cfg = cli.parse("ddp", argv)
    lazy.import_now()  # the flags are good: torch and the rest, before any process group starts its threads
    spawn.start(train, cfg)  # train() runs here (torchrun, launch, srun) or in one process per GPU


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
    if cfg.sync_bn:  # BatchNorm statistics over the global batch, not over each process's share
        model = models.sync_batchnorm(model, cfg.arch)
    # Every process holds a replica; DDP averages the gradients across processes during backward
    # (--ddp-comm-hook: what it sends; --bucket-cap-mb, --static-graph: how).
    model, comm_hook = comm.distributed_model(model, cfg, ctx)

    optimizer = engine.sgd(model, plan.lr, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov,  # fused on GPUs
                           norm_weight_decay=cfg.norm_weight_decay, bias_weight_decay=cfg.bias_weight_decay)
    session.run(plan, ctx, log, model, optimizer, policy, loaders, comm_hook)  # resume, train, validate; or --evaluate


if __name__ == "__main__":
    cli.run(main)
