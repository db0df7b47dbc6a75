"""Other formats in and out: :mod:`.hf` (Hugging Face DiffLlama / Llama checkpoints),
:mod:`.unilm` (the official PyTorch modules' weights) and :mod:`.conversion` (a standard model
converted into DIFF V2 or V1)."""

from diffjax.interop.unilm import load_unilm_state_dict, unilm_state_dict

__all__ = ["load_unilm_state_dict", "unilm_state_dict"]
