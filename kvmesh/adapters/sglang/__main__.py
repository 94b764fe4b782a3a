"""``python -m kvmesh.adapters.sglang ...``: SGLang's server with kvmesh (see :mod:`.launcher`)."""

from kvmesh.adapters.sglang.launcher import main

if __name__ == "__main__":
    main()
