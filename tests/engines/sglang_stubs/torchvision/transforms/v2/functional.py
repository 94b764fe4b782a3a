"""TEST-ONLY stand-in for torchvision.transforms.functional (see the package docstring)."""


def __getattr__(name: str) -> object:
    if name == "InterpolationMode":
        from torchvision.transforms import InterpolationMode

        return InterpolationMode
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: object, **kwargs: object) -> object:
        raise RuntimeError(f"torchvision.transforms.functional.{name} is a test stub")

    return unavailable
