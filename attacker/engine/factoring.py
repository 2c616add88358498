"""Low-rank targets: a captured one-step gradient of a Linear layer is itself sum_s delta*_s a*_s^T
over the victim's rows, so its rank is at most B*T. Such a target is factored once, exactly
(G*_j = L_j R_j^T up to float rounding, ``factor_targets``), and <g_j, G*_j> = sum_t (L_j^T delta_t).(R_j^T a_t)
never reads the weight-sized target again. Each layer takes the factored or the dense form by a
FLOP/bytes estimate (``dot_costs``); the dense form stays for targets whose rank is not small (early
convolutions, ViT layers at B >= 4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Bytes are weighed as this many FLOPs in the per-layer choice: roughly the fp32 FLOPs a CPU or
# GPU core does in the time it streams one byte (GEMM peak / memory bandwidth); only the order of
# magnitude matters, the costs it separates differ by far more.
FLOPS_PER_BYTE = 8.0
# Relative Frobenius error a factored target may have against the dense one (float32 rounding of a
# sum is about 1e-7 per term); beyond it the layer stays dense.
FACTOR_RTOL = 1e-5


def dot_costs(rows: int, out_f: int, in_f: int, rank: int | None, gram: bool) -> tuple[float, float]:
    """Estimated cost of <g, G*> per job for one layer: (dense, factored), in FLOPs plus weighted
    bytes (fp32), forward only (the double backward scales with it). Factored is inf without factors."""
    if gram:  # dense: (d @ G*) . a, streaming the target
        dense = 2.0 * rows * out_f * in_f + FLOPS_PER_BYTE * 4 * out_f * in_f
    else:  # dense: g (built anyway for ||g||^2) . G*
        dense = 2.0 * out_f * in_f + FLOPS_PER_BYTE * 4 * 2 * out_f * in_f
    if rank is None:
        return dense, float("inf")
    factored = 2.0 * rows * rank * (out_f + in_f) + FLOPS_PER_BYTE * 4 * (rows + rank) * (out_f + in_f)
    return dense, factored


def useful_rank(out_f: int, in_f: int) -> int:
    """The largest rank at which factors are cheaper to store and stream than the dense target."""
    return int(0.75 * out_f * in_f / (out_f + in_f))


@torch.no_grad()
def factor_targets(target: Tensor, max_rank: int, chunk: int = 16) -> tuple[Tensor, Tensor] | None:
    """Exact low-rank factors of V target matrices, or None when some job's rank exceeds max_rank.

    target: (V, out, in). Returns (L, R), L: (V, out, k), R: (V, in, k), with target[j] = L[j] R[j]^T
    up to float rounding (checked: relative Frobenius error <= FACTOR_RTOL for every job, else None;
    None as well when a target holds inf or nan).
    How: a randomized range finder (Halko, Martinsson & Tropp), in float64: Y = G Omega for a Gaussian
    Omega with K columns, Q = qr(Y), C = Q^T G; when the numerical rank of C is below K the sketch has
    caught the whole range of G, and the SVD of C (through a QR of C^T, so only a K x K matrix is
    decomposed) gives factors cut at that rank (singular values under 16 epsilons of the target's
    dtype, relative to the largest, are rounding noise). K grows 8, 32, ..., max_rank + 8 until a
    rank gap shows or the rank is past max_rank. Deterministic (fixed seed), on the target's device;
    ``chunk`` jobs at a time bound the float64 copies."""
    V, out_f, in_f = target.shape
    full = min(out_f, in_f)
    work = torch.float64 if target.device.type in ("cpu", "cuda") else target.dtype
    # Rounding noise: the target's own (float32 data), or the working precision's over a dot product.
    eps = max(torch.finfo(target.dtype).eps, torch.finfo(work).eps * max(out_f, in_f))
    gen = torch.Generator(device=target.device).manual_seed(0)
    lefts, rights = [], []
    for start in range(0, V, chunk):
        G = target[start : start + chunk].to(work)
        norm2 = torch.linalg.vector_norm(G, dim=(1, 2)).pow(2)
        if not bool(torch.isfinite(norm2).all()):
            return None  # a non-finite target stays dense: its job diverges as it would without factors
        K = 8
        while True:
            Kc = min(K, full)
            omega = torch.randn(in_f, Kc, generator=gen, device=G.device, dtype=work)
            Q, _ = torch.linalg.qr(G @ omega)  # (n, out, Kc): the sketched range
            # C = Q^T G (Kc x in) = R2^T Q2^T by a QR of C^T; the SVD is then of the small Kc x Kc R2^T.
            Q2, R2 = torch.linalg.qr(G.transpose(1, 2) @ Q)
            U, S, Wh = torch.linalg.svd(R2.transpose(1, 2))
            rank = int((S > 16 * eps * S[:, :1]).sum(1).max())
            if rank < Kc or Kc == full:
                break
            if Kc > max_rank:
                return None
            K = min(4 * K, max_rank + 8)
        if rank > max_rank:
            return None
        # ||G - L R^T||^2 = ||G||^2 - ||Q^T G||^2 (what the sketch missed) + the cut singular values^2
        # = ||G||^2 - sum of the kept S^2 (Q orthonormal); float64 resolves it to ~1e-8 relative.
        err2 = norm2 - S[:, :rank].pow(2).sum(1)
        if bool((err2 > FACTOR_RTOL**2 * norm2).any()):
            return None
        left = (Q @ U[:, :, :rank]) * S[:, None, :rank]
        right = Q2 @ Wh[:, :rank].transpose(1, 2)
        lefts.append(left)
        rights.append(right)
    k = max(t.shape[2] for t in lefts)  # pad every chunk to the largest rank (zero columns add nothing)
    pad = lambda t: F.pad(t, (0, k - t.shape[2])).to(target.dtype)  # noqa: E731
    return torch.cat([pad(t) for t in lefts]), torch.cat([pad(t) for t in rights])
