"""TEST-ONLY stand-in for torchvision, used by the SGLang engine tier (tests/engines/test_sglang_*.py).

Why: SGLang 0.5.23 imports ``torchvision.transforms`` at module import time (through
``sglang.srt.configs`` -> multimodal helpers), even for text-only code paths such as the radix
cache and the HTTP server. The only torchvision wheels the package registries serve for torch
2.13 are linked against CUDA torch (``libtorch_cuda.so``) and fail to import on the CPU build
(``operator torchvision::nms does not exist``). This package only makes those module-level
imports succeed; every callable raises, so a test that reached real image code would fail loudly.
It is put on ``sys.path`` only when no working torchvision is installed (tests/engines/sglang_env.py).
"""

from torchvision import transforms

__version__ = "0.0.0+kvmesh-test-stub"
__all__ = ["transforms"]


def __getattr__(name: str) -> object:
    raise AttributeError(f"torchvision test stub has no {name!r} (image code is not under test)")
