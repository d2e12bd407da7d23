"""Text -> tokens for the zoo: a byte-level BPE tokenizer and cached token-id arrays.

Usage (tests/test_zoo.py runs this on tests/data/corpus_sample):
    tok = train_tokenizer(Path("corpus"), vocab_size=8192)   # PreTrainedTokenizerFast
    ids_N = tokenize_split(tok, Path("corpus"), "train")     # uint16, documents end in EOS
    batch_BS = sample_batch(ids_N, batch_size=8, seq_len=256, seed=0, step=17)

The corpus directory is what `tensorbend zoo corpus` writes: `train/*.txt` and `heldout/*.txt`,
documents separated by a form feed line. The tokenizer sees only the train split.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from tensorbend.errors import ZooError

EOS_TOKEN = "<|endoftext|>"
DOC_SEPARATOR = "\f\n"


def iter_documents(corpus: Path, split: str) -> Iterator[str]:
    """Documents of one split of a corpus directory, in a fixed order."""
    files = sorted((Path(corpus) / split).glob("*.txt"))
    if not files:
        raise ZooError(
            f"corpus {corpus}: expected {split}/*.txt files, found none "
            "(prepare one with `tensorbend zoo corpus --out DIR`)"
        )
    for path in files:
        for doc in path.read_text(encoding="utf-8").split(DOC_SEPARATOR):
            if doc.strip():
                yield doc


def train_tokenizer(corpus: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE on the train split; EOS doubles as BOS and padding, as in GPT-2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents(corpus, "train"), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1_000_000,
    )


def tokenize_split(
    tok: PreTrainedTokenizerFast, corpus: Path, split: str, progress: bool = False
) -> np.ndarray:
    """All documents of `split` as one uint16 array, each document followed by EOS."""
    docs = list(iter_documents(corpus, split))
    eos = tok.eos_token_id
    parts = []
    chunk = 256
    for i in tqdm(
        range(0, len(docs), chunk),
        desc=f"tokenize {split}",
        unit="chunk",
        disable=not progress,
        file=sys.stderr,
    ):
        for ids in tok.backend_tokenizer.encode_batch(docs[i : i + chunk]):
            parts.append(np.asarray(ids.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def sample_batch(
    ids_N: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int
) -> torch.Tensor:
    """[B, S] random windows; a pure function of (seed, step), so a resumed run sees the same data."""
    if len(ids_N) <= seq_len + 1:
        raise ZooError(
            f"corpus: expected more than {seq_len + 1} training tokens, found {len(ids_N)} "
            "(use a bigger corpus or a smaller --size)"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts_B = torch.randint(0, len(ids_N) - seq_len, (batch_size,), generator=g).tolist()
    return torch.from_numpy(np.stack([ids_N[s : s + seq_len] for s in starts_B]).astype(np.int64))


def heldout_windows(ids_N: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """[W, S] non-overlapping windows spread evenly over all held-out tokens (every source)."""
    n_windows = min(len(ids_N), max_tokens) // seq_len
    if n_windows == 0:
        raise ZooError(
            f"corpus: expected at least {seq_len} held-out tokens, found {len(ids_N)} "
            "(the corpus needs documents in heldout/)"
        )
    stride = len(ids_N) // n_windows
    starts = np.arange(n_windows) * stride
    return torch.from_numpy(np.stack([ids_N[s : s + seq_len] for s in starts]).astype(np.int64))
