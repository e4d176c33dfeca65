#!/usr/bin/env python
"""Train and validate an ImageNet classifier on one device: a GPU, or the CPU.

    python imagenet_nd.py -a resnet50 /path/to/imagenet

The whole recipe, top to bottom; the loop itself is common/engine.py.
"""
import torch

from common import checkpoint, cli, data, distributed, engine, models, precision, preemption, schedules, telemetry


def main(argv=None):
    cfg = cli.parse("nd", argv)
    train(cfg, distributed.single_process(cfg.device))


def train(cfg: cli.Config, ctx: distributed.Context) -> None:
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

    global_batch = cfg.batch_size * ctx.replicas
    lr = schedules.scaled_lr(cfg.lr, global_batch)
    optimizer = engine.sgd(model, lr, cfg.momentum, cfg.weight_decay)  # fused on GPUs
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
