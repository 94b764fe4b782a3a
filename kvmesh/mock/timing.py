"""How long a simulated engine step takes: the reference mocker's fitted model.

NVIDIA Dynamo's mocker fitted these curves to a real vLLM deployment (milliseconds):

* prefill of ``T`` new tokens in a step: ``4.209989e-07*T^2 + 1.518344e-02*T + 16.50142``;
* decode: ``max(1, -25.74*p^2 + 54.01*p + 5.74)``, with ``p`` the used share of the KV cache.

A mixed step pays both, one after the other, as the reference does: the step's prefill work
first, then the forward pass that emits tokens. A step that only advances a chunk of a long
prompt (no request emits a token) pays the prefill part alone; a pure decode step pays the
decode part alone. Everything is divided by ``--speedup``.

:func:`profile` is the same model as data, what ``kvmesh mock --report-profile`` serves in
``/kvmesh/info`` so a router can start from the engine's real curve instead of a guess.
"""

from __future__ import annotations

from typing import Any

PREFILL_MS = (4.209989e-07, 1.518344e-02, 16.50142)
"""Prefill step ms = c2*T^2 + c1*T + c0, T = new prompt tokens in the step."""
DECODE_MS = (-25.74, 54.01, 5.74)
"""Decode step ms = max(DECODE_MIN_MS, c2*p^2 + c1*p + c0), p = used share of the KV cache."""
DECODE_MIN_MS = 1.0


def prefill_ms(new_tokens: int) -> float:
    if new_tokens <= 0:
        return 0.0
    t = float(new_tokens)
    c2, c1, c0 = PREFILL_MS
    return c2 * t * t + c1 * t + c0


def decode_ms(kv_usage: float) -> float:
    p = min(max(kv_usage, 0.0), 1.0)
    c2, c1, c0 = DECODE_MS
    return max(DECODE_MIN_MS, c2 * p * p + c1 * p + c0)


def step_seconds(num_prefill_tokens: int, num_emitting: int, kv_usage: float, speedup: float) -> float:
    """Modelled wall time of one step, in seconds."""
    ms = prefill_ms(num_prefill_tokens)
    if num_emitting:
        ms += decode_ms(kv_usage)
    return ms / (1000.0 * speedup)


def profile(speedup: float) -> dict[str, Any]:
    """The step model as ``/kvmesh/info`` reports it: wall-clock ms, the speed-up already applied.

    ``prefill_ms`` are the coefficients ``[c2, c1, c0]`` of a step's prefill time in its new
    tokens; ``decode_ms`` those of a decode step's time in the KV usage share, floored at
    ``decode_min_ms``.
    """
    return {
        "prefill_ms": [c / speedup for c in PREFILL_MS],
        "decode_ms": [c / speedup for c in DECODE_MS],
        "decode_min_ms": DECODE_MIN_MS / speedup,
    }
