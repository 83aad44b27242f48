"""Token batches: the same global batch, in the same order, whatever the DP/CP/PP split.

Every rank derives the whole global batch of step `s` from (seed, s) alone and keeps its
slice, so no data moves between ranks and a 1-rank plan sees exactly the tokens a 64-rank
plan sees. Rows: DP rank d, micro-batch m owns rows [(d * M + m) * b, ... + b) of the global
batch (M micro-batches of b rows per DP rank). Columns: CP rank c owns the zig-zag chunks
c and 2*cp-1-c of the sequence, which balances causal attention work across the ring.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from autoplan.errors import UserError


def zigzag_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions held by `cp_rank`: chunks r and 2*cp-1-r of 2*cp equal chunks."""
    if seq_len % (2 * cp):
        raise UserError(f"seq_len {seq_len} must be a multiple of 2*cp = {2 * cp} for "
                        "zig-zag context parallelism; pick a seq_len divisible by it.")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


class SyntheticTokens:
    """Uniform random token ids; step s of seed k is generated from its own RNG stream."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seed = seed

    def global_batch(self, step: int, rows: int, seq_len: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab_size, (rows, seq_len + 1), generator=gen)


class TokenFile:
    """A flat binary file of token ids (uint16 when the vocab fits, else uint32), memory-mapped.

    Each row starts at an offset drawn from (seed, step), so resumption needs no file state.
    The file's size is checked when it is opened and every batch's ids against the
    vocabulary; `check_token_file` also scans the whole file (before the ranks start).
    """

    def __init__(self, path: str, vocab_size: int, seed: int, dtype: str | None = None,
                 seq_len: int = 1) -> None:
        self.path, self.vocab_size, self.seed = path, vocab_size, seed
        name = token_dtype_name(vocab_size, dtype)
        self.dtype = getattr(torch, name)
        self.num_tokens = token_count(path, name, seq_len)
        # shared=True maps the file (mmap) instead of reading it; nothing is written to it.
        self.tokens = torch.from_file(path, shared=True, size=self.num_tokens, dtype=self.dtype)

    def global_batch(self, step: int, rows: int, seq_len: int) -> torch.Tensor:
        if self.num_tokens <= seq_len + 1:
            raise UserError(f"the token file holds {self.num_tokens} tokens, fewer than seq_len+1.")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.num_tokens - seq_len - 1, (rows,), generator=gen)
        batch = torch.stack([self.tokens[s: s + seq_len + 1].to(torch.int64) for s in starts.tolist()])
        top = int(batch.max())
        if top >= self.vocab_size:
            raise UserError(_id_too_large(self.path, top, self.vocab_size, self.dtype))
        return batch


def token_dtype_name(vocab_size: int, dtype: str | None) -> str:
    name = dtype or ("uint16" if vocab_size <= 65536 else "uint32")
    if name not in ("uint16", "uint32"):
        raise UserError(f"--data-dtype {name!r}: use uint16 or uint32.")
    return name


def token_count(path: str, dtype_name: str, seq_len: int) -> int:
    """Tokens in the file; a UserError when it is missing, empty, ragged or too short."""
    if not Path(path).is_file():
        raise UserError(f"--data {path!r} is not a file; give a token .bin file or 'synthetic'.")
    itemsize = 2 if dtype_name == "uint16" else 4
    nbytes = os.path.getsize(path)
    if nbytes % itemsize:
        raise UserError(f"--data {path}: {nbytes} bytes is not a whole number of {dtype_name} "
                        f"tokens ({itemsize} bytes each); check --data-dtype or the file.")
    count = nbytes // itemsize
    if count < seq_len + 2:
        raise UserError(f"--data {path} holds {count} {dtype_name} tokens; a training row needs "
                        f"seq_len + 1 = {seq_len + 1} and the file at least one more. Give a "
                        "longer token file (or 'synthetic').")
    return count


def _id_too_large(path: str, top: int, vocab_size: int, dtype) -> str:
    return (f"--data {path} holds token id {top}, but the model's vocabulary has {vocab_size} "
            f"ids (0..{vocab_size - 1}); the file was tokenized for another vocabulary or is "
            f"not {str(dtype).replace('torch.', '')} (--data-dtype). Re-tokenize it for this model.")


def check_token_file(path: str, vocab_size: int, seq_len: int, dtype: str | None = None,
                     chunk_tokens: int = 1 << 24) -> int:
    """Size, dtype and the largest id of the whole file, read in chunks; returns the token count."""
    name = token_dtype_name(vocab_size, dtype)
    count = token_count(path, name, seq_len)
    tokens = torch.from_file(path, shared=True, size=count, dtype=getattr(torch, name))
    for start in range(0, count, chunk_tokens):
        top = int(tokens[start: start + chunk_tokens].to(torch.int64).max())  # no max for uint16
        if top >= vocab_size:
            raise UserError(_id_too_large(path, top, vocab_size, tokens.dtype))
    return count


def make_source(data: str, vocab_size: int, seed: int, dtype: str | None = None, seq_len: int = 1):
    if data == "synthetic":
        return SyntheticTokens(vocab_size, seed)
    return TokenFile(data, vocab_size, seed, dtype, seq_len)


def local_microbatches(batch: torch.Tensor, *, dp_rank: int, num_microbatches: int,
                       micro_batch: int, positions: torch.Tensor | None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) per micro-batch for this DP rank, restricted to its CP positions."""
    out = []
    for m in range(num_microbatches):
        start = (dp_rank * num_microbatches + m) * micro_batch
        rows = batch[start: start + micro_batch]
        inputs, labels = rows[:, :-1], rows[:, 1:]
        if positions is not None:
            inputs, labels = inputs[:, positions], labels[:, positions]
        out.append((inputs.contiguous(), labels.contiguous()))
    return out


_SAMPLE_BYTES = 1 << 20
_SAMPLES = 16


def data_fingerprint(path: str) -> dict:
    """The token file's size and a sha256 of sampled 1 MiB blocks (the first, the last and
    evenly spaced ones between, at most 18 MiB read whatever the file's size).

    Hashing a multi-TB file would take hours on every resume; a truncated, appended or
    replaced file changes the size or almost surely a sampled block. An in-place edit of a
    region no block samples goes unnoticed. The modification time is not compared: copying a
    file to another disk changes it without changing a token."""
    size = os.path.getsize(path)
    offsets = {0, max(0, size - _SAMPLE_BYTES)}
    offsets.update(size * i // (_SAMPLES + 1) for i in range(1, _SAMPLES + 1))
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for offset in sorted(offsets):
            fh.seek(offset)
            digest.update(fh.read(_SAMPLE_BYTES))
    return {"path": str(path), "bytes": size, "sampled_sha256": digest.hexdigest()}


def data_record(data: str) -> dict:
    """What a checkpoint stores about --data (trainer.json's "data")."""
    return data_fingerprint(data) if data != "synthetic" else {"path": "synthetic"}


def check_same_data(saved: dict | None, data: str, allow_change: bool) -> str | None:
    """Refuses (UserError) a token file that differs from the one the checkpoint was trained
    on; returns a note to print (a change allowed, nothing recorded), else None."""
    if saved is None:
        return "autoplan: the checkpoint records no data fingerprint; --data is not compared"
    now = data_record(data)
    changed = _data_changes(saved, now)
    if not changed:
        return None
    what = "; ".join(changed)
    if allow_change:
        return f"autoplan: --allow-data-change: resuming on changed data ({what})"
    raise UserError(f"--data {data}: the data changed since the checkpoint was saved ({what}). "
                    "Resuming on other tokens silently changes what the model trains on; "
                    "restore the original file, or pass --allow-data-change to resume on this "
                    "data anyway.")


def _data_changes(saved: dict, now: dict) -> list[str]:
    if (saved["path"] == "synthetic") != (now["path"] == "synthetic"):
        return [f"the checkpoint trained on {saved['path']}, this run on {now['path']}"]
    if now["path"] == "synthetic":
        return []
    changes = []
    if saved["bytes"] != now["bytes"]:
        changes.append(f"{saved['bytes']:,} bytes then, {now['bytes']:,} now")
    elif saved["sampled_sha256"] != now["sampled_sha256"]:
        changes.append("same size, but sampled blocks of its contents differ")
    return changes
