#!/usr/bin/env python
"""Train and validate an ImageNet classifier with DistributedDataParallel and
mixed precision: imagenet_ddp.py plus NVIDIA Apex's --opt-level O0..O3,
implemented with native PyTorch AMP (no Apex needed).

    python -m torch.distributed.launch --nproc_per_node=4 imagenet_ddp_apex.py -a resnet50 --b 208 --workers 20 --opt-level O2 DATA
    python imagenet_ddp_apex.py -a resnet50 --opt-level O1 DATA     # every GPU of this machine; torchrun and srun too

The whole recipe, top to bottom; the loop itself is common/engine.py, finding
the other processes is common/distributed.py, and precision is common/precision.py.
"""
import torch

from common import checkpoint, cli, data, distributed, engine, models, precision, preemption, schedules, telemetry


def main(argv=None):
    cfg = cli.parse("ddp_apex", argv)
    distributed.launch(train, cfg)  # train() runs here (torchrun, launch, srun) or in one process per GPU


def train(cfg: cli.Config, ctx: distributed.Context) -> None:
    log = telemetry.RunLog(ctx)
    engine.seed_everything(cfg.seed, cfg.deterministic)

    loaders = data.build_loaders(cfg, ctx)
    model = models.build_model(cfg.arch, loaders.num_classes, pretrained=cfg.pretrained, image_size=cfg.image_size,
                               dropout=cfg.dropout)
    policy = precision.build_policy(cfg.opt_level, cfg.amp_dtype, ctx.device, cfg.keep_batchnorm_fp32, cfg.loss_scale)
    channels_last = models.uses_channels_last(cfg.memory_format, ctx.device, policy)  # --memory-format
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = policy.prepare_model(model.to(ctx.device, memory_format=memory_format))  # O3: the model in half
    model = models.compiled(model, cfg.compile)  # --compile
    if cfg.sync_bn:  # BatchNorm statistics over the global batch, not over each process's share
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # Every process holds a replica; DDP averages the gradients across processes during backward.
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    global_batch = cfg.batch_size * ctx.replicas
    lr = schedules.scaled_lr(cfg.lr, global_batch)
    optimizer = engine.sgd(model, lr, cfg.momentum, cfg.weight_decay,  # fused on GPUs (not under fp16 loss scaling)
                           loss_scaling=policy.scales_loss)
    schedule = schedules.LRSchedule(lr, cfg.epochs, cfg.lr_schedule, cfg.lr_steps, warmup_epochs=cfg.warmup_epochs)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    # --resume: where the checkpoint stopped, to the step; otherwise --start-epoch.
    start = checkpoint.resume(cfg, ctx, model, optimizer, policy, loaders.classes, log,
                              global_batch=global_batch, lr=lr)

    trainer = engine.Trainer(model, criterion, optimizer, schedule, policy, ctx, log, print_freq=cfg.print_freq,
                             channels_last=channels_last, steps_per_epoch=cfg.steps_per_epoch,
                             warmup_steps=cfg.warmup_steps, max_nonfinite_steps=cfg.max_nonfinite_steps,
                             control=preemption.StopControl.for_run(cfg, ctx))
    log.info(f"{cfg.arch} on {ctx.device_name()}, {loaders.summary()}")
    log.info(policy.describe())
    if cfg.evaluate:
        val, report = trainer.validate(loaders, start.start_epoch)
        log.evaluation(val, report, loaders.classes, report_dir=cfg.report_dir)
        return
    log.info(f"global batch {global_batch} ({cfg.batch_size} per replica x {ctx.replicas}); "
             f"lr {cfg.lr:g} x {global_batch}/256 = {lr:g}, {cfg.lr_schedule} schedule")
    log.start_run(cfg, start, resolved={
        "global_batch": global_batch, "lr": lr, "precision": policy.name, "channels_last": channels_last,
        "num_classes": loaders.num_classes, "train_images": len(loaders.train.dataset),
        "val_images": len(loaders.val.dataset),
        "steps_per_epoch": loaders.train_steps(cfg.steps_per_epoch),
        "checkpoint_bytes": checkpoint.expected_bytes(model, optimizer),  # checked against the free space
    })
    trainer.fit(loaders, cfg.epochs, start, engine.RunFacts.of(cfg, global_batch, lr), desired_acc=cfg.desired_acc)


if __name__ == "__main__":
    cli.run(main)
