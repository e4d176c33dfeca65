#!/usr/bin/env python
"""Train and validate an ImageNet classifier with DistributedDataParallel and
mixed precision: imagenet_ddp.py plus NVIDIA Apex's --opt-level O0..O3,
implemented with native PyTorch AMP (no Apex needed).

    python -m torch.distributed.launch --nproc_per_node=4 imagenet_ddp_apex.py -a resnet50 --b 208 --workers 20 --opt-level O2 DATA
    python imagenet_ddp_apex.py -a resnet50 --opt-level O1 DATA     # every GPU of this machine; torchrun and srun too

The whole recipe, top to bottom; the loop itself is common/engine.py and common/fit.py, finding
the other processes is common/launcher.py and common/spawn.py, and precision is common/precision.py.
"""
from __future__ import annotations

from common import cli, config, lazy

# torch, and the modules of common/ that use it, are imported once the flags are read (main, lazy.import_now):
# --help and a mistake in a flag answer at once, not after the ~4 s import of torch and torchvision.
torch, comm, data, distributed, engine, models, precision, session, spawn, telemetry = lazy.modules(
    "torch", "common.comm", "common.data", "common.distributed", "common.engine", "common.models",
    "common.precision", "common.session", "common.spawn", "common.telemetry")


def main(argv=None):
    cfg = cli.parse("ddp_apex", argv)
    lazy.import_now()  # the flags are good: torch and the rest, before any process group starts its threads
    spawn.start(train, cfg)  # train() runs here (torchrun, launch, srun) or in one process per GPU


def train(cfg: config.Config, ctx: distributed.Context) -> None:
    log = telemetry.RunLog(ctx)
    engine.seed_everything(cfg.seed, cfg.deterministic)
    policy = precision.build_policy(cfg.opt_level, cfg.amp_dtype, ctx.device, cfg.keep_batchnorm_fp32,
                                    cfg.loss_scale, clip_grad_norm=cfg.clip_grad_norm)  # --opt-level: Apex's O0..O3
    plan = session.Plan.of(cfg, ctx, policy)  # global batch, scaled lr, memory format: derived once

    loaders = data.build_loaders(cfg, ctx)
    model = models.build_model(cfg.arch, loaders.num_classes, pretrained=cfg.pretrained, image_size=cfg.image_size,
                               dropout=cfg.dropout, other_sizes=cfg.crop_sizes.model_inputs(),
                               blurpool=cfg.blurpool, drop_path=cfg.drop_path, pretrained_file=cfg.pretrained_file)
    model = policy.prepare_model(model.to(ctx.device, memory_format=plan.memory_format))  # O3: the model in half
    model = models.compiled(model, cfg.compile)  # --compile
    if cfg.sync_bn:  # BatchNorm statistics over the global batch, not over each process's share
        model = models.sync_batchnorm(model, cfg.arch)
    # Every process holds a replica; DDP averages the gradients across processes during backward
    # (--ddp-comm-hook: what it sends; --bucket-cap-mb, --static-graph: how).
    model, comm_hook = comm.distributed_model(model, cfg, ctx)

    optimizer = engine.sgd(model, plan.lr, cfg.momentum, cfg.weight_decay,  # fused on GPUs, not under fp16 scaling
                           loss_scaling=policy.scales_loss, nesterov=cfg.nesterov,
                           norm_weight_decay=cfg.norm_weight_decay, bias_weight_decay=cfg.bias_weight_decay)
    session.run(plan, ctx, log, model, optimizer, policy, loaders, comm_hook)  # resume, train, validate; or --evaluate


if __name__ == "__main__":
    cli.run(main)
