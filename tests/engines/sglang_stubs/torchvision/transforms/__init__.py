"""TEST-ONLY stand-in for torchvision.transforms (see the package docstring)."""

import enum

from torchvision.transforms import functional as functional


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: object, **kwargs: object) -> object:
        raise RuntimeError(f"torchvision.transforms.{name} is a test stub (image code is not under test)")

    return unavailable
