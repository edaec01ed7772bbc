"""A stand-in for torchvision that lets `import timm` succeed where the real one cannot load.

timm 1.0 lists torchvision as a hard requirement and imports it when timm itself is
imported, but its models never call it: at import time it reads only the names below (found
by reading timm 1.0.31's sources and by importing it over a recording finder), for its data
pipeline and its batch-norm freezing helpers. PyPI's only torchvision for torch 2.13
(0.28.0) is a CUDA build that fails to load against the CPU torch wheel this project installs
(libc10_cuda.so missing), so the `bench` extra installs timm without its dependencies.

The folder holding this file's `torchvision` package is put on `sys.path` by
`sample_models.timm_zoo.import_timm` only while it imports timm, and only when the real
torchvision is absent or fails to import; the stub's modules are taken out of
`sys.modules` afterwards, so nothing else ever sees them. Every class here refuses to be
made (`Unavailable`): timm's data pipeline, `FrozenBatchNorm2d` and the datasets need the
real torchvision.

| timm module (at import) | what it takes from torchvision |
|---|---|
| timm.layers.create_norm, .norm_act; timm.utils.model | `ops.misc.FrozenBatchNorm2d` |
| timm.data.dataset_factory | `datasets.{CIFAR10, CIFAR100, MNIST, KMNIST, FashionMNIST, ImageFolder}` (the others it tries are optional) |
| timm.data.transforms | `transforms.ToTensor` (subclassed), `transforms.functional.InterpolationMode` (its six members) |
| timm.data.transforms_factory, .naflex_transforms | `transforms`, `transforms.functional` (modules; members read only when called) |
| timm.layers._fx | `models.feature_extraction` (optional: absent here, so timm's FX feature extraction is off) |
"""
