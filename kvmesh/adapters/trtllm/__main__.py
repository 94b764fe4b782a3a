"""``python -m kvmesh.adapters.trtllm``: see :mod:`kvmesh.adapters.trtllm.launcher`."""

from kvmesh.adapters.trtllm.launcher import main

raise SystemExit(main())
