"""The public surface of the package root is deliberate: this pins it."""

import kvmesh


def test_all_is_sorted_and_complete() -> None:
    assert kvmesh.__all__ == sorted(kvmesh.__all__)
    for name in kvmesh.__all__:
        assert getattr(kvmesh, name) is not None


def test_exported_members() -> None:
    assert set(kvmesh.__all__) == {
        "ConfigError",
        "KvMeshError",
        "MalformedEventError",
        "NvextError",
        "RequestError",
        "WorkerError",
        "block_hashes",
        "sequence_hashes",
    }
