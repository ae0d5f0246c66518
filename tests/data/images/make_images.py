"""Writes the JPEG test images of tests/test_image.cpp and what Pillow decodes them to.

Each <name>.jpg comes with <name>.pillow.png: Image.open(<name>.jpg).convert("RGB"), the pixels
timm's loader hands to its transforms. linvis must decode every JPEG here to exactly those pixels.
Run with any Python that has Pillow (the peer venv of bench/compare_torch.sh has it):
    python tests/data/images/make_images.py
"""
from pathlib import Path

from PIL import Image

HERE = Path(__file__).resolve().parent
HEIGHT, WIDTH = 27, 41  # not multiples of the 16-pixel MCU: the edge blocks are partial


def pattern():
    """A deterministic picture with smooth and sharp parts (integer arithmetic only)."""
    image = Image.new("RGB", (WIDTH, HEIGHT))
    pixels = image.load()
    for y in range(HEIGHT):
        for x in range(WIDTH):
            ring = ((x - 20) ** 2 + (y - 13) ** 2) // 16 % 2
            pixels[x, y] = ((x * 6 + y * 2) % 256, (y * 9 + 40 * ring) % 256, (x * y + 60 * ((x // 7 + y // 5) % 2)) % 256)
    return image


def main():
    rgb = pattern()
    files = {
        "rgb_q75_420.jpg": (rgb, dict(quality=75, subsampling="4:2:0")),
        "rgb_q90_444_progressive.jpg": (rgb, dict(quality=90, subsampling="4:4:4", progressive=True)),
        "rgb_q85_422_restart.jpg": (rgb, dict(quality=85, subsampling="4:2:2", restart_marker_blocks=2)),
        "gray_q80.jpg": (rgb.convert("L"), dict(quality=80)),
        "cmyk_q85_adobe.jpg": (rgb.convert("CMYK"), dict(quality=85)),
    }
    for name, (image, options) in files.items():
        path = HERE / name
        image.save(path, "JPEG", **options)
        Image.open(path).convert("RGB").save(path.with_suffix(".pillow.png"))
        print(path.name, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
