"""How long a simulated engine step takes: the reference mocker's fitted model.

NVIDIA Dynamo's mocker fitted these curves to a real vLLM deployment (milliseconds):

* prefill of ``T`` new tokens in a step: ``4.209989e-07*T^2 + 1.518344e-02*T + 16.50142``;
* decode: ``max(1, -25.74*p^2 + 54.01*p + 5.74)``, with ``p`` the used share of the KV cache.

A mixed step pays both, one after the other, as the reference does: the step's prefill work
first, then the forward pass that emits tokens. A step that only advances a chunk of a long
prompt (no request emits a token) pays the prefill part alone; a pure decode step pays the
decode part alone. Everything is divided by ``--speedup``.
"""

from __future__ import annotations

PREFILL_MS_COEFFICIENTS = (4.209989e-07, 1.518344e-02, 16.50142)
"""(a2, a1, a0): prefill ms = a2*T^2 + a1*T + a0; ``/kvmesh/info`` reports it as ``prefill_profile_ms``."""


def prefill_ms(new_tokens: int) -> float:
    if new_tokens <= 0:
        return 0.0
    t = float(new_tokens)
    a2, a1, a0 = PREFILL_MS_COEFFICIENTS
    return a2 * t * t + a1 * t + a0


def decode_ms(kv_usage: float) -> float:
    p = min(max(kv_usage, 0.0), 1.0)
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


def step_seconds(num_prefill_tokens: int, num_emitting: int, kv_usage: float, speedup: float) -> float:
    """Modelled wall time of one step, in seconds."""
    ms = prefill_ms(num_prefill_tokens)
    if num_emitting:
        ms += decode_ms(kv_usage)
    return ms / (1000.0 * speedup)
