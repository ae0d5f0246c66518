#!/usr/bin/env python3
"""Writes the torch.save-format test checkpoints in this folder with CPython's own pickler.

No torch is needed: stand-in classes registered under the real module names (torch,
torch._utils, yacs.config, numpy) reduce themselves exactly as torch 1.13/2.x tensors,
parameters, storages, yacs CfgNode and numpy scalars do, so the pickle opcode stream is
the one torch.save produces (protocol 2 by default, 4 with pickle_protocol=4). The zip
layout follows torch.save: <archive>/data.pkl, byteorder, data/<key>, .data/serialization_id,
version. Storage contents follow simple formulas that tests/test_torch_checkpoint.cpp
re-creates independently:
  float32/float64 storage k of n elements: value[i] = 0.5 * i - 3 + k
  float16 storage: value[i] = 0.25 * i - 1        bfloat16: value[i] = 0.5 * i - 2
  int64: value[i] = 1e10 + i                     (num_batches_tracked: a 0-d int64 = 1234)
Run: python3 make_checkpoints.py   (from this folder)
"""
import argparse
import collections
import copyreg
import io
import pickle
import struct
import sys
import types
import zipfile


def module(name):
    if name not in sys.modules:
        sys.modules[name] = types.ModuleType(name)
    return sys.modules[name]


torch = module("torch")
torch_utils = module("torch._utils")
torch._utils = torch_utils


def _rebuild_tensor_v2(*args):
    raise RuntimeError("stand-in")


def _rebuild_parameter(*args):
    raise RuntimeError("stand-in")


for fn in (_rebuild_tensor_v2, _rebuild_parameter):
    fn.__module__ = "torch._utils"
    setattr(torch_utils, fn.__name__, fn)

STORAGE_FORMAT = {"FloatStorage": "f", "DoubleStorage": "d", "HalfStorage": "e", "LongStorage": "q",
                  "BFloat16Storage": "bf16"}
for cls_name in STORAGE_FORMAT:
    cls = type(cls_name, (), {"__module__": "torch"})
    setattr(torch, cls_name, cls)


class Storage:
    """A typed storage: pickled only through persistent_id, like torch.save does."""
    counter = 0

    def __init__(self, kind, values):
        self.kind, self.values = kind, values
        self.key = str(Storage.counter)
        Storage.counter += 1

    def raw(self):
        if self.kind == "BFloat16Storage":
            return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:] for v in self.values)
        return struct.pack("<%d%s" % (len(self.values), STORAGE_FORMAT[self.kind]), *self.values)


class Tensor:
    """Reduces like torch.Tensor._reduce_ex_internal for a CPU dense tensor."""

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)

    def __reduce_ex__(self, protocol):
        return (_rebuild_tensor_v2,
                (self.storage, self.offset, self.size, self.stride, False, collections.OrderedDict()))


class Parameter(Tensor):
    def __reduce_ex__(self, protocol):
        data = Tensor(self.storage, self.offset, self.size, self.stride)
        return (_rebuild_parameter, (data, True, collections.OrderedDict()))


def contiguous(kind, size, fill):
    n = 1
    for s in size:
        n *= s
    stride, acc = [], 1
    for s in reversed(size):
        stride.insert(0, acc)
        acc *= s
    return Tensor(Storage(kind, [fill(i) for i in range(n)]), 0, size, stride)


def state_dict(items):
    sd = collections.OrderedDict(items)
    sd._metadata = collections.OrderedDict([("", {"version": 1})])
    return sd


# yacs CfgNode: a dict subclass with four attributes set in __init__
yacs = module("yacs")
yacs_config = module("yacs.config")
yacs.config = yacs_config


class CfgNode(dict):
    def __init__(self, init_dict=None):
        super().__init__(init_dict or {})
        self.__dict__["__immutable__"] = False
        self.__dict__["__deprecated_keys__"] = set()
        self.__dict__["__renamed_keys__"] = {}
        self.__dict__["__new_allowed__"] = False


CfgNode.__module__ = "yacs.config"
yacs_config.CfgNode = CfgNode

# numpy scalar: numpy.core.multiarray.scalar(dtype('float64'), raw bytes)
numpy = module("numpy")
numpy_core = module("numpy.core")
numpy_multiarray = module("numpy.core.multiarray")


def scalar(*args):
    raise RuntimeError("stand-in")


scalar.__module__ = "numpy.core.multiarray"
numpy_multiarray.scalar = scalar


class dtype:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return (dtype, (self.code, False, True), (3, "<", None, None, None, -1, -1, 0))


dtype.__module__ = "numpy"
numpy.dtype = dtype


class Float64Scalar:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return (scalar, (dtype("f8"), struct.pack("<d", self.value)))


def save(obj, path, protocol):
    storages = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Storage):
                storages[obj.key] = obj
                numel = len(obj.values)
                return ("storage", getattr(torch, obj.kind), obj.key, "cpu", numel)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=protocol).dump(obj)
    archive = "archive"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(archive + "/data.pkl", buf.getvalue())
        z.writestr(archive + "/byteorder", b"little")
        for key in sorted(storages, key=int):
            z.writestr(archive + "/data/" + key, storages[key].raw())
        z.writestr(archive + "/.data/serialization_id", b"1234567890")
        z.writestr(archive + "/version", b"3\n")


def f32(k):
    return lambda i: 0.5 * i - 3 + k


def vit3_checkpoint():
    """ViT³/H-ViT³ save_checkpoint: model, optimizer, lr_scheduler, max_accuracy(_e), epoch, config."""
    Storage.counter = 0
    qkv = contiguous("FloatStorage", (6, 4), f32(0))
    # a non-contiguous view of qkv's storage: qkv.t()[1:3, 2:5] -> offset 2*4+1, size (2, 3), stride (1, 4)
    view = Tensor(qkv.storage, 9, (2, 3), (1, 4))
    model = state_dict([
        ("blocks.0.attn.qkv.weight", Parameter(qkv.storage, 0, (6, 4), (4, 1))),
        ("blocks.0.attn.w1", contiguous("DoubleStorage", (1, 2, 2, 2), f32(1))),
        ("blocks.0.attn.proj.weight", contiguous("HalfStorage", (4, 3), lambda i: 0.25 * i - 1)),
        ("blocks.0.norm1.weight", contiguous("BFloat16Storage", (5,), lambda i: 0.5 * i - 2)),
        ("patch_embed.norm.num_batches_tracked", Tensor(Storage("LongStorage", [1234]), 0, (), ())),
        ("pos_index", contiguous("LongStorage", (3,), lambda i: 10000000000 + i)),
        ("qkv_view", view),
    ])
    exp_avg = contiguous("FloatStorage", (6, 4), f32(2))
    optimizer = {
        "state": {0: {"step": 3, "exp_avg": exp_avg, "exp_avg_sq": exp_avg}},
        "param_groups": [{"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05,
                          "amsgrad": False, "params": [0]}],
    }
    config = CfgNode({"MODEL": CfgNode({"TYPE": "vittt", "NAME": "vittt_tiny", "DROP_PATH_RATE": 0.1}),
                      "DATA": CfgNode({"IMG_SIZE": 224, "DATASET": "imagenet"}),
                      "TRAIN": CfgNode({"EPOCHS": 300, "BASE_LR": 5e-4})})
    config.__dict__["__immutable__"] = True
    return {"model": model, "optimizer": optimizer,
            "lr_scheduler": {"t_initial": 300, "warmup_t": 20, "base_values": [5e-4]},
            "max_accuracy": Float64Scalar(76.5), "max_accuracy_e": Float64Scalar(-84.9), "epoch": 299,
            "config": config}


def dit3_checkpoint():
    """DiT³ train.py: model (DDP, module. prefix), ema, opt, args (argparse.Namespace)."""
    Storage.counter = 0
    w = contiguous("FloatStorage", (3, 2), f32(3))
    model = state_dict([("module.x_embedder.proj.weight", w),
                        ("module.pos_embed", contiguous("FloatStorage", (1, 4, 2), f32(4)))])
    ema = state_dict([("x_embedder.proj.weight", contiguous("FloatStorage", (3, 2), f32(5))),
                      ("pos_embed", contiguous("FloatStorage", (1, 4, 2), f32(6)))])
    args = argparse.Namespace(model="DiT-B/2", image_size=256, num_classes=1000, global_batch_size=256,
                              global_seed=0, vae="ema", lr=1e-4, ckpt=None, use_layer_lr=True)
    return {"model": model, "ema": ema, "opt": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]},
            "args": args}


if __name__ == "__main__":
    save(vit3_checkpoint(), "vit3_style.pth", protocol=2)
    save(dit3_checkpoint(), "dit3_style.pt", protocol=4)
    save(dit3_checkpoint(), "dit3_style_p5.pt", protocol=5)
