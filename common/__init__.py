"""Shared package of the ImageNet reference trainer.

Every entry script (imagenet_nd.py, imagenet_dp.py, imagenet_ddp.py,
imagenet_ddp_apex.py) is a short recipe over these modules; the training loop
itself lives once, in common.engine (a step, an epoch) and common.fit (the
epochs), and common.session assembles a run for it.
"""
