"""Stub `torchvision.ops`: only `misc` (see `sample_models.torchvision_stub`)."""
