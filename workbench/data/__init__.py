"""Sequence-length data: synthetic families fitted to published figures, the embedded stdlib
corpus, lengths from files, the max-context policy, summary statistics and global-batch sampling;
the token cache of a user's text (``tokens``) and the token ids of training sequences
(``sequences.TokenData``).

Pure Python + numpy; pyarrow, datasets and tokenizers are imported only by the file readers that
need them.
"""

from .corpus import Document, document_tokens, stdlib_documents, stdlib_lengths
from .families import (
    FAMILIES,
    LognormalFamily,
    QuantileFamily,
    UniformFamily,
    get_family,
    synthetic_lengths,
)
from .files import LENGTH_COLUMNS, FileLengths, detect_format, read_lengths_file
from .sampler import Batch, GlobalBatchSampler
from .source import (
    DEFAULT_SAMPLES,
    POLICIES,
    SOURCE_NAMES,
    LengthSet,
    MaxContextReport,
    apply_max_context,
    is_length_list,
    load_lengths,
    parse_length_list,
)
from .stats import SHARE_THRESHOLDS, length_histogram, summarize, token_share_curve

__all__ = [
    "DEFAULT_SAMPLES",
    "FAMILIES",
    "LENGTH_COLUMNS",
    "POLICIES",
    "SHARE_THRESHOLDS",
    "SOURCE_NAMES",
    "Batch",
    "Document",
    "FileLengths",
    "GlobalBatchSampler",
    "LengthSet",
    "LognormalFamily",
    "MaxContextReport",
    "QuantileFamily",
    "UniformFamily",
    "apply_max_context",
    "detect_format",
    "document_tokens",
    "get_family",
    "is_length_list",
    "length_histogram",
    "load_lengths",
    "parse_length_list",
    "read_lengths_file",
    "stdlib_documents",
    "stdlib_lengths",
    "summarize",
    "synthetic_lengths",
    "token_share_curve",
]
