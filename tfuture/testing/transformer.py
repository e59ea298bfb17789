"""A small random-weight causal transformer (torch only, no downloads) for real-use checks.

Unlike the toy model, its next token depends on the whole sequence. The sequence lives on the
device in a token cache ``[max_requests, max_len]`` that each forward extends with its resolved
input ids, the way a KV cache is extended, so the host never needs a token's value to run the
next step: overlap works exactly as it would with a real model.
"""

from __future__ import annotations

import math

import torch

from tfuture.core.batch import ForwardBatch
from tfuture.testing.toy import greedy_sample


class TinyTransformer:
    """``n_layers`` pre-norm attention + MLP blocks over a token cache, float64 throughout.

    Args:
        vocab: vocabulary size; logits are ``[n_sample, vocab]`` (the sampling rows only).
        max_requests: request ids must lie in ``[0, max_requests)`` (they index the cache).
        max_len: longest sequence (prompt plus generated tokens).
        seed: weights are drawn from this seed, so two instances compute the same function.
    """

    def __init__(
        self,
        vocab: int = 64,
        *,
        d_model: int = 32,
        n_heads: int = 2,
        n_layers: int = 2,
        max_requests: int = 64,
        max_len: int = 128,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if d_model % n_heads:
            raise ValueError(f"d_model must be a multiple of n_heads ({n_heads}), got {d_model}")
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.n_heads, self.max_len = vocab, n_heads, max_len
        self.device = torch.device(device)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[0])).to(
                self.device
            )

        self.embed = w(vocab, d_model) * math.sqrt(vocab)
        self.pos = w(max_len, d_model) * math.sqrt(max_len)
        self.layers = [
            (w(d_model, 3 * d_model), w(d_model, d_model), w(d_model, 4 * d_model), w(4 * d_model, d_model))
            for _ in range(n_layers)
        ]
        self.head = w(d_model, vocab)
        self.cache = torch.zeros(max_requests, max_len, dtype=torch.int64, device=self.device)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Append this step's tokens to the cache, then logits at each request's last position."""
        n_reqs = batch.req_ids.numel()
        if n_reqs == 0:
            return torch.zeros(0, self.vocab, dtype=torch.float64, device=self.device)
        # Request of each row: segments are back to back, each ends at its last row.
        ends = batch.last_rows + 1
        seg_lens = torch.diff(ends, prepend=ends.new_zeros(1))
        row_req = torch.repeat_interleave(batch.req_ids, seg_lens, output_size=batch.input_ids.numel())
        self.cache[row_req, batch.positions] = batch.input_ids.to(torch.int64)
        length = int(self.max_len)
        seqs = self.cache.index_select(0, batch.req_ids)  # [n_reqs, max_len]
        x = self.embed[seqs] + self.pos  # [n_reqs, L, d]
        valid = torch.arange(length, device=self.device)[None, :] < batch.seq_lens[:, None]
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
        allowed = causal[None, :, :] & valid[:, None, :]
        for qkv_w, out_w, up_w, down_w in self.layers:
            x = x + self._attention(_norm(x) @ qkv_w, allowed) @ out_w
            x = x + torch.relu(_norm(x) @ up_w) @ down_w
        # Logits for the sampling requests only: their last position.
        sample = batch.sample_reqs
        if sample.numel() == 0:
            return torch.zeros(0, self.vocab, dtype=x.dtype, device=self.device)
        last = x[sample, batch.seq_lens.index_select(0, sample) - 1]
        return _norm(last) @ self.head

    def _attention(self, qkv: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        n, length, three_d = qkv.shape
        d = three_d // 3
        q, k, v = qkv.view(n, length, 3, self.n_heads, d // self.n_heads).unbind(2)
        scores = torch.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(d // self.n_heads)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        # Padding rows attend to nothing; their NaN never reaches a valid row.
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1))
        return torch.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, length, d)

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        return greedy_sample(logits, batch, mask)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)
