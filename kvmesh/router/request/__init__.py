"""From an OpenAI-style request to what the core routes on: token ids, ``nvext`` and override headers.

Pure by rule: parsing and tokenization only, no I/O.
"""
