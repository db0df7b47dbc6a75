"""Data for diffjax: the byte tokenizer, corpora (the built-in stdlib corpus, text files,
pre-tokenized files), synthetic retrieval tasks (multi-needle, MQAR; each declares its
validation metrics: :func:`validation_metrics`) and the grain pipeline.

    from diffjax.data import DataConfig, check_data, make_dataset

    config = DataConfig(source="stdlib", seq_len=256)
    print(check_data(config, vocab_size=259).description)   # fails early on bad data
    it = iter(make_dataset(config, "train", batch_size=16))
    batch = next(it)        # {"inputs": [16, 256] int32, "targets": ..., "weights": ...,
                            #  "segment_ids", "positions": documents kept apart}
    state = it.get_state()  # resume later with it.set_state(state)
"""

from diffjax.data.config import (
    COMPONENT_SOURCES,
    MIXTURE_EXHAUSTED,
    SOURCES,
    STDLIB_PARTS,
    TOKEN_DTYPES,
    DataConfig,
    DataError,
    MixtureComponent,
    MixtureData,
    MqarData,
    NeedleData,
    StdlibData,
    SyntheticData,
    TokensData,
)
from diffjax.data.documents import DocumentIndex, SpecialTokens, mark_documents
from diffjax.data.mixture import MixturePlan, Stage, batches_read, resume_stages
from diffjax.data.pipeline import (
    DataSummary,
    carries_documents,
    check_data,
    component_sources,
    mixture_plan,
    describe,
    make_dataset,
    make_source,
    num_examples,
    num_tokens,
    steps_per_epoch,
    validation_metrics,
)
from diffjax.data.sources import (
    TokenStream,
    WindowSource,
    is_validation_file,
    load_corpus,
    stdlib_files,
    stdlib_root,
)
from diffjax.data.synthetic import (
    RETRIEVAL_METRICS,
    MQARSource,
    NeedleSource,
    ValidationMetric,
    answer_accuracy,
    answer_correct,
    query_correct,
    query_kinds,
)
from diffjax.data.tokenizer import (
    BOS,
    EOS,
    PAD,
    VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
)

__all__ = [
    "BOS",
    "COMPONENT_SOURCES",
    "MIXTURE_EXHAUSTED",
    "MixtureComponent",
    "MixtureData",
    "MqarData",
    "NeedleData",
    "StdlibData",
    "SyntheticData",
    "TokensData",
    "STDLIB_PARTS",
    "MixturePlan",
    "Stage",
    "batches_read",
    "component_sources",
    "mixture_plan",
    "resume_stages",
    "EOS",
    "PAD",
    "RETRIEVAL_METRICS",
    "SOURCES",
    "TOKEN_DTYPES",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "DataConfig",
    "HFTokenizer",
    "load_tokenizer",
    "DataError",
    "DataSummary",
    "DocumentIndex",
    "MQARSource",
    "NeedleSource",
    "SpecialTokens",
    "TokenStream",
    "ValidationMetric",
    "WindowSource",
    "answer_accuracy",
    "answer_correct",
    "carries_documents",
    "check_data",
    "describe",
    "is_validation_file",
    "load_corpus",
    "make_dataset",
    "make_source",
    "mark_documents",
    "num_examples",
    "num_tokens",
    "query_correct",
    "query_kinds",
    "stdlib_files",
    "stdlib_root",
    "steps_per_epoch",
    "validation_metrics",
]
