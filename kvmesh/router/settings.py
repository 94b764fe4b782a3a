"""Public path of the router's deployment settings (``from kvmesh.router.settings import ...``).

The settings live with the fleet runtime in :mod:`kvmesh.router.mesh.settings`; this module keeps the
documented import path stable for users.
"""

from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec, parse_worker_list

__all__ = ["MeshSettings", "WorkerSpec", "parse_worker_list"]
