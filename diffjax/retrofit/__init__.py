"""Retrofit a pretrained standard-attention model (a diffjax twin or a Hugging Face Llama)
into DIFF V2 or DIFF V1 and continue training it (``python -m diffjax.retrofit SOURCE OUT``);
see :mod:`diffjax.retrofit.core` for the weight mapping and the ramp."""

from diffjax.interop.conversion import (
    RampSchedule,
    RetrofitConfig,
    logit_gap,
    ramp_values,
    retrofit_config,
    retrofit_model,
    set_ramp,
    v1_source_heads,
)

__all__ = [
    "RampSchedule",
    "RetrofitConfig",
    "logit_gap",
    "ramp_values",
    "retrofit_config",
    "retrofit_model",
    "set_ramp",
    "v1_source_heads",
]
