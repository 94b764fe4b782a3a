"""`kvmesh bench`: a load generator for any OpenAI-compatible endpoint (workloads, runner, report)."""
