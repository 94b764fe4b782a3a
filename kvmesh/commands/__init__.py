"""Sub-commands of the ``kvmesh`` CLI, one module each."""
