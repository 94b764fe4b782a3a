"""Backend adapters: engine glue. Each sub-package imports its engine lazily, inside functions."""
