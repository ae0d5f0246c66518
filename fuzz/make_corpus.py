#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer targets (fuzz/corpus/<target>/) with the Python
standard library only; JPEG seeds are encoded by Debian's libstb (stbi_write_jpg, the encoder
linvis itself uses) through ctypes, and skipped when libstb is not installed. Run from the repository root:
    python3 fuzz/make_corpus.py
Seeds are small on purpose (libFuzzer mutates them); each target's input format is described at
the top of fuzz/<target>.cpp.
"""
import gzip
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
CKPT = os.path.join(ROOT, "tests", "data", "torch_checkpoints")
IMAGES = os.path.join(ROOT, "tests", "data", "images")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ------------------------------------------------------------------ images
def png(width, height, color_type=2, bit_depth=8, palette=None, interlace=0):
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color_type]
    raw = b""
    for y in range(height):
        raw += b"\x00" + bytes(((x * 37 + y * 11 + c * 70) % 256) for x in range(width) for c in range(channels))
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xffffffff)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, interlace))
    if palette is not None:
        out += chunk(b"PLTE", palette)
    return out + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def bmp(width, height, bits=24):
    row = ((width * bits // 8) + 3) & ~3
    pixels = b""
    for y in range(height):
        line = bytes(((x * 29 + y * 7 + c * 50) % 256) for x in range(width) for c in range(bits // 8))
        pixels += line + b"\x00" * (row - len(line))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(pixels), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bits, 0, len(pixels), 2835, 2835, 0, 0)
    return header + info + pixels


def jpeg_seeds():
    import ctypes
    import ctypes.util
    lib = ctypes.util.find_library("stb")
    if lib is None:
        return {}
    stb = ctypes.CDLL(lib)
    seeds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (w, h, comp, quality) in {"rgb.jpg": (12, 9, 3, 90), "gray.jpg": (8, 8, 1, 75),
                                            "q10.jpg": (17, 5, 3, 10)}.items():
            pixels = bytes(((i * 37) % 251) for i in range(w * h * comp))
            out = os.path.join(tmp, name)
            if not stb.stbi_write_jpg(out.encode(), w, h, comp, pixels, quality):
                sys.exit("stbi_write_jpg failed for " + name)
            with open(out, "rb") as f:
                seeds[name] = f.read()
    return seeds


def images():
    seeds = {"rgb.png": png(7, 5), "gray.png": png(6, 4, 0), "rgba.png": png(5, 5, 6), "gray_alpha.png": png(4, 3, 4),
             "palette.png": png(5, 4, 3, palette=bytes(range(0, 255, 1))[:3 * 16]),
             "interlaced.png": png(9, 7, 2, interlace=1), "rgb16.png": png(3, 3, 2, 16),
             "rgb24.bmp": bmp(5, 3), "rgba32.bmp": bmp(4, 4, 32)}
    seeds.update(jpeg_seeds())
    # Pillow-written JPEGs of the decoder's golden test: progressive, restart markers, Adobe CMYK.
    for name in ("rgb_q90_444_progressive.jpg", "rgb_q85_422_restart.jpg", "cmyk_q85_adobe.jpg"):
        with open(os.path.join(IMAGES, name), "rb") as f:
            seeds[name] = f.read()
    return seeds


# ------------------------------------------------------------------ checkpoints
def pth():
    for name in sorted(os.listdir(CKPT)):
        if name.endswith((".pt", ".pth")):
            with open(os.path.join(CKPT, name), "rb") as f:
                data = f.read()
            put("pth", "file_" + name, b"\x00" + data)  # even first byte: a whole file
            if data[:2] == b"PK":
                with zipfile.ZipFile(os.path.join(CKPT, name)) as z:
                    pkl = [n for n in z.namelist() if n.endswith("data.pkl")][0]
                    put("pth", "pickle_" + name + ".pkl", b"\x01" + z.read(pkl))  # odd: a bare data.pkl
    # small pickles with storages "0".."3" (64 zero bytes each) and the allow-list in play
    class G:
        def __init__(self, module, name):
            self.module, self.name = module, name
    small = {
        "dict_protocol2.pkl": pickle.dumps({"a": [1, 2.5, "x", b"y", None, True], "b": (1, 2), 3: {4, 5}}, protocol=2),
        "nested_protocol4.pkl": pickle.dumps([[[]], {"k": [(), ()]}, 10**30, -5], protocol=4),
        "protocol0.pkl": pickle.dumps({"lr": 0.5, "name": "deit", "n": [1, 2]}, protocol=0),
        "tensor.pkl": (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00(X\x01\x00\x00\x00storageq\x01ctorch\nFloatStorage\n"
                       b"q\x02X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x10tQK\x02K\x02K\x03\x86K\x03K\x01\x86\x89"
                       b"ccollections\nOrderedDict\n)Rq\x03tR."),
        "refused_global.pkl": b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00echo\x85R.",
    }
    for name, data in small.items():
        put("pth", name, b"\x01" + data)
    # a minimal zip with a pickle that names a refused global
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "evil.pth")
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for name, data in (("archive/data.pkl", small["refused_global.pkl"]), ("archive/version", b"3\n")):
                z.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
        with open(path, "rb") as f:
            put("pth", "file_refused_global.pth", b"\x00" + f.read())


# ------------------------------------------------------------------ IDX, CIFAR
def idx(dims, values):
    return struct.pack(">BBBB", 0, 0, 8, len(dims)) + b"".join(struct.pack(">I", d) for d in dims) + bytes(values)


def idx_seeds():
    labels = idx([6], [0, 1, 2, 9, 5, 3])
    imgs = idx([2, 4, 3], [(i * 13) % 256 for i in range(24)])
    put("idx", "labels.idx1", b"\x00" + labels)
    put("idx", "labels.idx1.gz", b"\x00" + gzip.compress(labels, mtime=0))
    put("idx", "images.idx3", b"\x01" + imgs)
    put("idx", "images.idx3.gz", b"\x01" + gzip.compress(imgs, mtime=0))
    put("idx", "empty_images.idx3", b"\x01" + idx([0, 28, 28], []))


def cifar_seeds():
    rec10 = lambda label: bytes([label]) + bytes((i * 7 + label) % 256 for i in range(3072))
    rec100 = lambda coarse, fine: bytes([coarse, fine]) + bytes((i * 5 + fine) % 256 for i in range(3072))
    put("cifar", "cifar10_two.bin", b"\x00" + rec10(3) + rec10(9))
    put("cifar", "cifar100_one.bin", b"\x01" + rec100(4, 77))


# ------------------------------------------------------------------ image folder
def tree(entries):
    out = b""
    for kind, name, payload in entries:
        name = name.encode()
        out += bytes([kind, len(name)]) + name
        if kind == 1:
            out += struct.pack("<H", len(payload)) + payload
        elif kind == 2:
            out += bytes([len(payload)]) + payload
    return out


def folder_seeds():
    p, b = png(3, 2), bmp(2, 2)
    put("image_folder", "two_classes", tree([(1, "cat/a.png", p), (1, "dog/b.bmp", b), (1, "dog/sub/c.PNG", p)]))
    put("image_folder", "broken_and_text", tree([(1, "a/x.png", b"not a png"), (1, "a/y.png", p), (1, "b/notes.txt", b"hi"),
                                                 (1, "b/z.jpg", p[:20])]))
    put("image_folder", "symlinks", tree([(1, "a/one.png", p), (0, "b", b""), (2, "b/link", b"../a"),
                                          (2, "a/loop", b".."), (2, "a/self", b"."), (2, "b/img.png", b"../a/one.png")]))
    put("image_folder", "empty_class", tree([(0, "a", b""), (1, "b/q.bmp", b)]))


if __name__ == "__main__":
    # Generated seeds are rewritten; regression_* files (inputs of fixed findings) are kept.
    for target in ("pth", "image", "idx", "cifar", "image_folder"):
        d = os.path.join(CORPUS, target)
        for name in os.listdir(d) if os.path.isdir(d) else []:
            if not name.startswith("regression_"):
                os.remove(os.path.join(d, name))
    for name, data in images().items():
        put("image", name, data)
    pth()
    idx_seeds()
    cifar_seeds()
    folder_seeds()
    print("seed corpora written under", CORPUS)
