"""Reconstruction and mask metrics for the gradient-leakage audit.

Three value spaces are reported, always labelled by a suffix:

* ``*_paper`` -- computed on the *normalized* tensors (the model's input space) with
  ``data_range = max_c 1/std_c`` (about 3.25 for MNIST, 4.05 for CIFAR-10). The paper's
  tables were produced this way (their MSE and PSNR pairs imply this range), so use these to compare.
* ``*_std`` -- the standard convention: images mapped back to [0, 1] (clamped), data_range 1.
* ``ssim_minmax`` -- SSIM after scaling each image on its own to [0, 1] by its minimum and maximum
  (data_range 1): the "ScaledSSIM" of the authors' later code and of their inverting-gradients fork.
  Insensitive to a reconstruction's brightness and contrast offsets, not to noise in a flat background.

LPIPS always takes [0, 1] images (scaled to [-1, 1] internally). A perfect reconstruction has
PSNR ``+inf`` (MSE is exactly 0); we keep it rather than capping it so that the number is not
silently made up, and :func:`summarize` then reports a mean of ``inf`` and a std of ``nan``.

Public API:
    data_range_paper, per_image_mse, image_metrics,
    match_reconstructions, LpipsScorer, backbone_checkpoint_path,
    mean_mask_distance, throughput_rate_distance, mask_metrics,
    summarize, score_batch
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import urllib.request
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from fedsim.atomic import atomic_path
from fedsim.data import denormalize_stats
from fedsim.net import probe_url

logger = logging.getLogger(__name__)

IMAGE_METRICS: tuple[str, ...] = (
    "ssim_paper",
    "psnr_paper",
    "mse_paper",
    "ssim_std",
    "psnr_std",
    "mse_std",
    "ssim_minmax",
)

# ---------------------------------------------------------------------------------------------
# Value spaces
# ---------------------------------------------------------------------------------------------


def data_range_paper(std: Sequence[float]) -> float:
    """Value range of normalized images: (1 - m)/s - (0 - m)/s = 1/s, the widest channel."""
    return float(max(1.0 / s for s in std))


def _to_unit_range(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Normalized images back to [0, 1], clamped (reconstructions can overshoot): the standard space."""
    return denormalize_stats(x.detach().float(), mean, std, clamp=True)


def per_image_mse(a: Tensor, b: Tensor) -> Tensor:
    """Mean squared error per image (over C, H, W) -> shape (N,)."""
    return ((a.detach().float() - b.detach().float()) ** 2).flatten(1).mean(dim=1)


def _check_pair(originals: Tensor, recons: Tensor) -> None:
    if originals.ndim != 4 or originals.shape != recons.shape:
        raise ValueError(
            f"expected two N x C x H x W batches of the same shape, got "
            f"{tuple(originals.shape)} and {tuple(recons.shape)}"
        )


def image_metrics(originals: Tensor, recons: Tensor, mean: Sequence[float], std: Sequence[float]) -> dict[str, Tensor]:
    """Per-image SSIM, PSNR and MSE in the paper and [0,1] spaces, and the min-max SSIM, pairing
    ``originals[i]`` with ``recons[i]``.

    Both inputs are *normalized* tensors (as fed to the model). Returns a dict with the keys of
    :data:`IMAGE_METRICS`, each a float tensor of shape (N,).
    """
    # Imported here: torchmetrics pulls in torchvision and torch._dynamo (about 2 s), which the CLIs'
    # processes that score nothing (a bad value, `presets`, a refused config) need not import.
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    _check_pair(originals, recons)
    x = originals.detach().float()
    y = recons.detach().float()
    dr = data_range_paper(std)
    x01, y01 = _to_unit_range(x, mean, std), _to_unit_range(y, mean, std)
    out: dict[str, Tensor] = {}
    for space, a, b, rng in (("paper", x, y, dr), ("std", x01, y01, 1.0)):
        # A float data_range (not a tuple) means torchmetrics does not clamp the inputs,
        # which is what we want for the unbounded normalized space.
        out[f"ssim_{space}"] = structural_similarity_index_measure(b, a, data_range=rng, reduction="none").reshape(-1)
        out[f"psnr_{space}"] = peak_signal_noise_ratio(b, a, data_range=rng, reduction="none", dim=(1, 2, 3)).reshape(
            -1
        )
        out[f"mse_{space}"] = per_image_mse(a, b)
    out["ssim_minmax"] = structural_similarity_index_measure(
        _minmax(y), _minmax(x), data_range=1.0, reduction="none"
    ).reshape(-1)
    return {k: out[k] for k in IMAGE_METRICS}


def _minmax(x: Tensor) -> Tensor:
    """Each image scaled to [0, 1] by its own minimum and maximum (a constant image becomes 0)."""
    flat = x.flatten(1)
    low, high = flat.min(1).values, flat.max(1).values
    scale = (high - low).clamp_min(1e-12)
    return ((flat - low[:, None]) / scale[:, None]).view_as(x)


# ---------------------------------------------------------------------------------------------
# Matching (B > 1)
# ---------------------------------------------------------------------------------------------


def match_reconstructions(
    originals: Tensor,
    recons: Tensor,
    labels: Tensor | None = None,
    recon_labels: Tensor | None = None,
) -> Tensor:
    """Hungarian assignment of reconstructions to originals on per-pair MSE.

    Returns ``perm`` (LongTensor, shape (N,)) such that ``recons[perm][i]`` is the reconstruction
    matched to ``originals[i]``. With ``labels`` (labels of the originals) only reconstructions
    of the same label are paired where possible; ``recon_labels`` default to ``labels``, i.e.
    reconstruction ``j`` was optimised for label ``labels[j]``.
    """
    _check_pair(originals, recons)
    n = originals.shape[0]
    a = originals.detach().float().flatten(1)
    b = recons.detach().float().flatten(1).to(a.device)
    cost = torch.cdist(a, b).pow(2) / a.shape[1]  # cost[i, j] = MSE(original i, recon j)
    cost_np = cost.cpu().double().numpy()
    if labels is not None:
        la = torch.as_tensor(labels).reshape(-1).cpu()
        lb = la if recon_labels is None else torch.as_tensor(recon_labels).reshape(-1).cpu()
        if la.numel() != n or lb.numel() != n:
            raise ValueError("labels must have one entry per image")
        forbidden = (la.view(-1, 1) != lb.view(1, -1)).numpy()
        # Big-M penalty instead of inf: any label-consistent assignment wins, yet an
        # inconsistent label multiset still yields an assignment instead of an error.
        penalty = (float(cost_np.max()) + 1.0) * (n + 1)
        cost_np = cost_np + forbidden * penalty
    rows, cols = linear_sum_assignment(cost_np)
    perm = torch.empty(n, dtype=torch.long)
    perm[torch.as_tensor(rows)] = torch.as_tensor(cols, dtype=torch.long)
    return perm


# ---------------------------------------------------------------------------------------------
# LPIPS
# ---------------------------------------------------------------------------------------------

# torchvision architecture behind each lpips net, and the file torchvision would cache
# (from torchvision.models.{AlexNet,SqueezeNet1_1,VGG16}_Weights.IMAGENET1K_V1.url).
_BACKBONES: dict[str, tuple[str, str]] = {
    "alex": ("alexnet", "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"),
    "squeeze": ("squeezenet1_1", "https://download.pytorch.org/models/squeezenet1_1-b8a52dc0.pth"),
    "vgg": ("vgg16", "https://download.pytorch.org/models/vgg16-397923af.pth"),
}

# AlexNet's pooling cannot process images under 31 px (MNIST is 28); smaller images are
# bilinearly upsampled to this size for every net so values stay comparable across nets.
LPIPS_MIN_SIZE = 32

LPIPS_UNAVAILABLE_MESSAGE = (
    "LPIPS unavailable: the ImageNet weights of the '{net}' backbone ({filename}) are not in "
    "{directory} and {reason}. LPIPS will be reported as None. To enable it, place {filename} "
    "in that folder (or point TORCH_HOME at a folder whose hub/checkpoints/ holds it)."
)

_lpips_warned = False  # one warning per process, however many scorers or batches


def backbone_checkpoint_path(net: str) -> Path:
    """Where torchvision caches the backbone weights of ``net`` (honours TORCH_HOME at call time)."""
    if net not in _BACKBONES:
        raise ValueError(f"unknown LPIPS net {net!r}; choose from {sorted(_BACKBONES)}")
    filename = _BACKBONES[net][1].rsplit("/", 1)[-1]
    return Path(torch.hub.get_dir()) / "checkpoints" / filename


def _download(url: str, dest: Path, timeout: float) -> None:
    """Fetch ``url`` to ``dest`` atomically; ``timeout`` bounds every socket operation.

    Our own fetch instead of torch.hub's, because torch.hub's has no timeout and would hang
    on a machine without network (the probe first bounds DNS as well).
    """
    probe_url(url, timeout)
    digest = hashlib.sha256()
    with atomic_path(dest, suffix=".partial") as tmp:
        with open(tmp, "wb") as fh, urllib.request.urlopen(url, timeout=timeout) as resp:
            while chunk := resp.read(1 << 20):
                fh.write(chunk)
                digest.update(chunk)
        # torchvision file names carry a sha256 prefix; check it like torch.hub does.
        m = re.search(r"-([a-f0-9]+)\.", dest.name)
        if m and not digest.hexdigest().startswith(m.group(1)):
            raise ValueError(f"checksum mismatch for {dest.name}")


class LpipsScorer:
    """Per-image LPIPS that never downloads unless allowed and never hangs or crashes.

    Args:
        net: "alex" (default), "squeeze" or "vgg".
        backbone_weights: "imagenet" (the cached torchvision checkpoint), "random" (random
            backbone, for tests of the plumbing; values are not meaningful), or a path to a
            torchvision state-dict file.
        allow_download: with "imagenet", fetch the checkpoint when it is not cached.
        download_timeout: seconds per socket operation of that fetch (fail fast offline).
        device: where to run; ``None`` follows the input tensors.

    The model is built lazily on first use. When the weights cannot be had, :attr:`available`
    is False, :attr:`unavailable_reason` holds the message, calls return ``None``, and one
    warning (:data:`LPIPS_UNAVAILABLE_MESSAGE`) is logged per process.
    """

    def __init__(
        self,
        net: str = "alex",
        backbone_weights: str | os.PathLike[str] = "imagenet",
        allow_download: bool = True,
        download_timeout: float = 5.0,
        device: torch.device | str | None = None,
    ) -> None:
        if net not in _BACKBONES:
            raise ValueError(f"unknown LPIPS net {net!r}; choose from {sorted(_BACKBONES)}")
        self.net = net
        self.backbone_weights = backbone_weights
        self.allow_download = allow_download
        self.download_timeout = download_timeout
        self.device = torch.device(device) if device is not None else None
        self.unavailable_reason: str | None = None
        self.unavailable_cause: str | None = None
        self._model: torch.nn.Module | None = None
        self._loaded = False

    @property
    def available(self) -> bool:
        """Whether LPIPS can be computed (loads the model on first access)."""
        self._ensure_loaded()
        return self._model is not None

    def _weights_file(self) -> Path | None:
        """Locate the backbone state dict; None (with a reason set) when it cannot be had."""
        if self.backbone_weights == "random":
            return None
        if self.backbone_weights != "imagenet":
            return Path(self.backbone_weights)
        path = backbone_checkpoint_path(self.net)
        if path.is_file():
            return path
        if not self.allow_download:
            reason = "downloads are disabled (allow_download=False)"
        else:
            url = _BACKBONES[self.net][1]
            try:
                _download(url, path, self.download_timeout)
                return path
            except Exception as exc:  # noqa: BLE001 - any failure just means "unavailable"
                reason = f"the download from {url} failed ({type(exc).__name__}: {exc})"
        self._mark_unavailable(path, reason)
        return None

    def _mark_unavailable(self, path: Path, reason: str) -> None:
        global _lpips_warned
        # the cause in one sentence (a report's line), beside the whole message with its advice
        self.unavailable_cause = (
            f"the ImageNet weights of the '{self.net}' backbone ({path.name}) are not in {path.parent} and {reason}"
        )
        self.unavailable_reason = LPIPS_UNAVAILABLE_MESSAGE.format(
            net=self.net, filename=path.name, directory=path.parent, reason=reason
        )
        if not _lpips_warned:
            _lpips_warned = True
            logger.warning(self.unavailable_reason)

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        weights = self._weights_file()
        if weights is None and self.backbone_weights != "random":
            return
        import lpips  # local import: only needed when LPIPS is actually computed

        with warnings.catch_warnings():
            # lpips passes torchvision's deprecated `pretrained=`; pnet_rand=True means
            # torchvision builds random weights and never touches the network.
            warnings.simplefilter("ignore")
            model = lpips.LPIPS(net=self.net, pnet_rand=True, verbose=False)
        if weights is not None:
            try:
                self._load_backbone(model, weights)
            except Exception as exc:  # noqa: BLE001 - a corrupt file must not crash a run
                self._mark_unavailable(weights, f"the file could not be loaded ({type(exc).__name__}: {exc})")
                return
        model.eval().requires_grad_(False)
        self._model = model

    @staticmethod
    def _load_backbone(model: torch.nn.Module, path: Path) -> None:
        # lpips splits torchvision's `features` into slices whose children keep their original
        # index as name, so each child maps to `features.<index>.*` in the checkpoint.
        state = torch.load(path, map_location="cpu", weights_only=True)
        for slice_ in model.net.children():
            for name, module in slice_.named_children():
                prefix = f"features.{name}."
                sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
                module.load_state_dict(sub, strict=True)

    @torch.no_grad()
    def __call__(self, images: Tensor, others: Tensor) -> Tensor | None:
        """Per-image LPIPS between two [0, 1] batches (N x C x H x W) -> (N,), or None."""
        _check_pair(images, others)
        self._ensure_loaded()
        if self._model is None:
            return None
        device = self.device if self.device is not None else images.device
        model = self._model.to(device)
        a = images.detach().float().to(device).clamp(0, 1)
        b = others.detach().float().to(device).clamp(0, 1)
        if a.shape[1] == 1:  # grayscale: the backbone expects RGB
            a, b = a.repeat(1, 3, 1, 1), b.repeat(1, 3, 1, 1)
        h, w = a.shape[-2:]
        if min(h, w) < LPIPS_MIN_SIZE:
            scale = LPIPS_MIN_SIZE / min(h, w)
            size = (max(LPIPS_MIN_SIZE, round(h * scale)), max(LPIPS_MIN_SIZE, round(w * scale)))
            a = torch.nn.functional.interpolate(a, size=size, mode="bilinear", align_corners=False)
            b = torch.nn.functional.interpolate(b, size=size, mode="bilinear", align_corners=False)
        # normalize=True: lpips maps [0, 1] to the [-1, 1] it expects.
        return model(a, b, normalize=True).reshape(-1).cpu()


# ---------------------------------------------------------------------------------------------
# Mask metrics
# ---------------------------------------------------------------------------------------------


def mean_mask_distance(learned: Sequence[Tensor], true: Sequence[Tensor]) -> float:
    """MMD (eq. 4): mean over layers of the per-element mean squared difference."""
    if len(learned) != len(true) or not learned:
        raise ValueError("need the same, non-zero number of learned and true masks")
    per_layer = []
    for a, t in zip(learned, true, strict=True):
        if a.shape != t.shape:
            raise ValueError(f"mask shapes differ: {tuple(a.shape)} vs {tuple(t.shape)}")
        per_layer.append(((a.detach().float() - t.detach().float().to(a.device)) ** 2).mean().item())
    return float(np.mean(per_layer))


def throughput_rate_distance(learned: Sequence[Tensor], p: float) -> float:
    """TRD (eq. 6): mean over layers of |p - (1 - mean(psi_A^(i)))|, psi_A the learned masks."""
    if not learned:
        raise ValueError("need at least one learned mask")
    return float(np.mean([abs(p - (1.0 - m.detach().float().mean().item())) for m in learned]))


def mask_metrics(learned: Sequence[Tensor], true: Sequence[Tensor], p: float) -> dict[str, float]:
    """Both mask metrics: ``{"mmd": ..., "trd": ...}``."""
    return {"mmd": mean_mask_distance(learned, true), "trd": throughput_rate_distance(learned, p)}


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


def summarize(values: Sequence[float] | Tensor | np.ndarray) -> tuple[float, float]:
    """(mean, population std) ignoring NaN; (nan, nan) when nothing is left.

    With +inf present (a perfect PSNR) the mean is inf and the std nan.
    """
    arr = np.asarray(values.detach().cpu().numpy() if isinstance(values, Tensor) else values, dtype=np.float64).reshape(
        -1
    )
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return math.nan, math.nan
    if not np.all(np.isfinite(arr)):
        return float(np.mean(arr)), math.nan  # avoid numpy's inf - inf warning
    return float(np.mean(arr)), float(np.std(arr))


def _pack(per_image: dict[str, Tensor | None]) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for name, vals in per_image.items():
        if vals is None:
            out[name] = None
            continue
        m, s = summarize(vals)
        out[name] = {"per_image": [float(v) for v in vals.tolist()], "mean": m, "std": s}
    return out


def _score_pairs(
    originals: Tensor,
    recons: Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    lpips_scorer: LpipsScorer | None,
) -> dict[str, dict[str, Any] | None]:
    per_image: dict[str, Tensor | None] = dict(image_metrics(originals, recons, mean, std))
    per_image["lpips"] = None
    if lpips_scorer is not None:
        per_image["lpips"] = lpips_scorer(_to_unit_range(originals, mean, std), _to_unit_range(recons, mean, std))
    return _pack(per_image)


def score_batch(
    originals: Tensor,
    recons: Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    lpips_scorer: LpipsScorer | None = None,
    match: bool = True,
    labels: Tensor | None = None,
) -> dict[str, Any]:
    """Score a reconstructed batch against its originals (both *normalized*, N x C x H x W).

    Returns::

        {
          "matched": bool,            # Hungarian matching applied (match=True and N > 1)
          "permutation": list[int],   # recons[permutation[i]] is paired with originals[i]
          "metrics": {name: {"per_image": [...], "mean": float, "std": float}},
          "unmatched_metrics": same as "metrics" in the given order, or None when not matched,
          "lpips_available": bool,
        }

    ``name`` runs over ssim_paper, psnr_paper, mse_paper, ssim_std, psnr_std, mse_std (see the
    module docstring for the two spaces) and lpips; ``metrics["lpips"]`` is None when no scorer
    is given or LPIPS is unavailable.
    """
    _check_pair(originals, recons)
    n = originals.shape[0]
    identity = list(range(n))
    perm = identity
    if match and n > 1:
        perm = match_reconstructions(originals, recons, labels).tolist()
    matched = match and n > 1
    unmatched = _score_pairs(originals, recons, mean, std, lpips_scorer)
    if matched and perm != identity:
        metrics = _score_pairs(originals, recons[torch.as_tensor(perm)], mean, std, lpips_scorer)
    else:
        metrics = unmatched  # same pairs, no need to compute twice
    return {
        "matched": matched,
        "permutation": perm,
        "metrics": metrics,
        "unmatched_metrics": unmatched if matched else None,
        "lpips_available": metrics["lpips"] is not None,
    }
