"""The Flax NNX modules: :mod:`.layers` (RMSNorm, rotary, SwiGLU, Linear), :mod:`.attention`
(DIFF V1, DIFF V2 and standard multi-head attention), :mod:`.model` (the decoder LM, scanned or
unrolled), :mod:`.decode` (the KV cache and ``generate``) and :mod:`.param_count`."""
