#!/usr/bin/env python3
"""Writes legacy.pt: a checkpoint in torch.save's legacy (pre-1.6, non-zip) format, the one
torch.save(obj, f, _use_new_zipfile_serialization=False) still writes, with CPython's own pickler
and the stand-in torch classes of make_checkpoints.py (no torch needed).

Layout (torch/serialization.py _legacy_save): five things back to back in one file,
  pickle(0x1950a86a20f9469cfc6c)   the magic number
  pickle(1001)                     the protocol version
  pickle(sys_info)                 {'protocol_version': 1001, 'little_endian': True, 'type_sizes': {...}}
  pickle(obj)                      persistent ids ('storage', storage_type, root_key, 'cpu', numel, view_metadata)
  pickle(sorted storage keys)
then for each key an int64 little-endian element count and the storage's raw bytes.
view_metadata is None, or (view_key, offset, size) in elements of the root storage for a storage view.
Contents (checked by tests/test_torch_checkpoint.cpp LegacyFormat*):
  model.a.weight   float32 (2, 3): 0.5 * i - 3          (storage 0)
  model.a.bias     float64 (3,):   0.5 * i - 2          (storage 1)
  model.half       float16 (4,):   0.25 * i - 1         (storage 2)
  model.steps      int64 ():       1234                 (storage 3)
  model.a_t        the transpose of model.a.weight (same storage 0, stride (1, 3))
  model.tail       float32 (2,): elements 4..5 of storage 4 (0.5 * i - 2, 6 elements), through a storage view
  epoch 7, args argparse.Namespace(lr=0.001, model='deit_tiny')
Run: python3 make_legacy.py   (from this folder)
"""
import argparse
import collections
import io
import pickle
import struct
import sys

import make_checkpoints as mc

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


class StorageView:
    """A view of a root Storage (old torch storage slicing): pickled with view metadata."""

    def __init__(self, root, offset, size):
        self.root, self.offset, self.size = root, offset, size
        self.key = root.key + "_view"


def save_legacy(obj, path, protocol=2):
    storages = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, StorageView):
                root = obj.root
                storages[root.key] = root
                return ("storage", getattr(mc.torch, root.kind), root.key, "cpu", len(root.values),
                        (obj.key, obj.offset, obj.size))
            if isinstance(obj, mc.Storage):
                storages[obj.key] = obj
                return ("storage", getattr(mc.torch, obj.kind), obj.key, "cpu", len(obj.values), None)
            return None

    buf = io.BytesIO()
    pickle.dump(MAGIC_NUMBER, buf, protocol=protocol)
    pickle.dump(PROTOCOL_VERSION, buf, protocol=protocol)
    sys_info = dict(protocol_version=PROTOCOL_VERSION, little_endian=True,
                    type_sizes=dict(short=2, int=4, long=4))
    pickle.dump(sys_info, buf, protocol=protocol)
    Pickler(buf, protocol=protocol).dump(obj)
    keys = sorted(storages, key=int)
    pickle.dump(keys, buf, protocol=protocol)
    for key in keys:
        s = storages[key]
        buf.write(struct.pack("<q", len(s.values)))
        buf.write(s.raw())
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def legacy_checkpoint():
    mc.Storage.counter = 0
    w = mc.contiguous("FloatStorage", (2, 3), lambda i: 0.5 * i - 3)
    b = mc.contiguous("DoubleStorage", (3,), lambda i: 0.5 * i - 2)
    h = mc.contiguous("HalfStorage", (4,), lambda i: 0.25 * i - 1)
    steps = mc.Tensor(mc.Storage("LongStorage", [1234]), 0, (), ())
    root = mc.Storage("FloatStorage", [0.5 * i - 2 for i in range(6)])
    tail = mc.Tensor(StorageView(root, 4, 2), 0, (2,), (1,))
    model = mc.state_dict([("a.weight", w), ("a.bias", b), ("half", h), ("steps", steps),
                           ("a_t", mc.Tensor(w.storage, 0, (3, 2), (1, 3))), ("tail", tail)])
    return {"model": model, "epoch": 7, "args": argparse.Namespace(lr=0.001, model="deit_tiny")}


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    save_legacy(legacy_checkpoint(), "legacy.pt")
