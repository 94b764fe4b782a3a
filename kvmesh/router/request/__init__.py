"""From an OpenAI-style request to what the core routes on: token ids, ``nvext`` and override headers.

Pure by rule: parsing and tokenization only, no I/O.
"""

from kvmesh._native import activate

# Its modules compiled with mypyc where a build of these very sources exists (kvmesh native build).
activate(__name__, __path__)
