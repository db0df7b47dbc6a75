"""The configuration of a Differential Transformer V2 written by diffjax (``save_pretrained``).

Loaded by ``transformers`` with ``trust_remote_code=True``; imports transformers only. A Llama
configuration whose ``num_attention_heads`` counts the query heads, 2h for h output heads:
query heads 2i and 2i + 1 form pair i; ``num_key_value_heads`` (h_kv) kv heads of width
``head_dim`` are shared by both maps of a pair.
"""

from transformers import LlamaConfig


class DiffTransformerV2Config(LlamaConfig):
    model_type = "diff_transformer_v2"
