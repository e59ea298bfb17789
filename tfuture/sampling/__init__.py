"""Per-request sampling on the device: parameters, seeded draws, penalties exact under overlap.

``SamplingParams`` (one request) packs into a ``PARAM_WORDS`` int64 row; a batch carries a
``[n_reqs, PARAM_WORDS]`` table (``pack_params``, ``check_packed_params``). ``Sampler.plan``
turns a step's table into one int64 word array on the host (staged into the step's single
host-to-device copy); ``prepare``, ``observe``, ``sample`` and ``record`` run on the forward
stream. Draws are ``uniform_draws(seed, position)``: a counter-based hash, no generator state.
"""

from tfuture.core.params import (
    GREEDY_BELOW,
    PARAM_WORDS,
    SEED_LIMIT,
    SamplingParams,
    check_packed_params,
    pack_params,
    unpack_params,
)
from tfuture.sampling.draws import uniform_draws
from tfuture.sampling.plan import SamplerPlan
from tfuture.sampling.sampler import Sampler, SamplerState

__all__ = [
    "GREEDY_BELOW",
    "PARAM_WORDS",
    "SEED_LIMIT",
    "Sampler",
    "SamplerPlan",
    "SamplerState",
    "SamplingParams",
    "check_packed_params",
    "pack_params",
    "uniform_draws",
    "unpack_params",
]
