"""Tests for attacker.metrics: no network, no GPU, a few seconds."""

from __future__ import annotations

import hashlib
import io
import logging
import math
import socket
import threading
import time
import urllib.request

import pytest
import torch

from attacker import metrics as M

MNIST_MEAN = (0.13066373765468597,)
MNIST_STD = (0.30810782313346863,)
CIFAR_MEAN = (0.4914672374725342, 0.4822617471218109, 0.4467701315879822)
CIFAR_STD = (0.24703224003314972, 0.24348513782024384, 0.26158785820007324)


def _normalize(x01: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x01 - m) / s


def _smooth_images(n: int, c: int, size: int = 28, seed: int = 0) -> torch.Tensor:
    """Blurry random images in [0.1, 0.9]: structured enough for SSIM to react to shifts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, c, size // 4, size // 4, generator=g)
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return 0.1 + 0.8 * x


@pytest.fixture(autouse=True)
def _reset_warning_flag(monkeypatch):
    # The "warn once per process" flag must not leak between tests.
    monkeypatch.setattr(M, "_lpips_warned", False)


@pytest.fixture
def no_network(monkeypatch):
    """Any download attempt fails immediately and is recorded."""
    calls: list[str] = []

    def fake_urlopen(url, *args, **kwargs):
        calls.append(url)
        raise OSError("network disabled in tests")

    def fake_getaddrinfo(host, *args, **kwargs):
        calls.append(host)
        raise socket.gaierror("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    return calls


@pytest.fixture
def empty_torch_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    return tmp_path / "torch_home"


# --- image metrics -------------------------------------------------------------------------


def test_data_range_paper():
    assert M.data_range_paper(MNIST_STD) == pytest.approx(3.2456, abs=1e-3)
    # max over channels of 1/std: the green channel, 1/0.24349 = 4.107 (red alone would be 4.048)
    assert M.data_range_paper(CIFAR_STD) == pytest.approx(4.1070, abs=1e-3)


def test_identical_images():
    x = _normalize(_smooth_images(3, 1), MNIST_MEAN, MNIST_STD)
    out = M.image_metrics(x, x.clone(), MNIST_MEAN, MNIST_STD)
    for space in ("paper", "std"):
        assert torch.allclose(out[f"ssim_{space}"], torch.ones(3))
        assert torch.all(out[f"mse_{space}"] == 0)
        # Documented choice: a perfect reconstruction has PSNR +inf (not capped).
        assert torch.all(torch.isinf(out[f"psnr_{space}"]) & (out[f"psnr_{space}"] > 0))


def test_shift_ordering():
    x = _normalize(_smooth_images(2, 3, size=32), CIFAR_MEAN, CIFAR_STD)
    ssim, mse = {}, {}
    for shift in (1, 2, 4):
        out = M.image_metrics(x, torch.roll(x, shifts=shift, dims=-1), CIFAR_MEAN, CIFAR_STD)
        ssim[shift], mse[shift] = out["ssim_std"], out["mse_std"]
        assert torch.all(out["ssim_paper"] < 1) and torch.all(out["mse_paper"] > 0)
        assert torch.all(ssim[shift] < 1) and torch.all(mse[shift] > 0)
    assert torch.all(ssim[1] > ssim[2]) and torch.all(ssim[2] > ssim[4])
    assert torch.all(mse[1] < mse[2]) and torch.all(mse[2] < mse[4])


def test_paper_vs_standard_space_mse():
    # Inside [0, 1] nothing is clamped, so normalizing divides every difference by std.
    x01 = _smooth_images(4, 1)
    y01 = _smooth_images(4, 1, seed=1)
    out = M.image_metrics(
        _normalize(x01, MNIST_MEAN, MNIST_STD), _normalize(y01, MNIST_MEAN, MNIST_STD), MNIST_MEAN, MNIST_STD
    )
    assert torch.allclose(out["mse_paper"], out["mse_std"] / MNIST_STD[0] ** 2, rtol=1e-4)
    # With one channel, data_range and MSE scale alike, so PSNR agrees in both spaces.
    assert torch.allclose(out["psnr_paper"], out["psnr_std"], atol=1e-3)


def test_psnr_constant_offset():
    # Offset 0.1 in [0, 1]: MSE_std = 0.01, PSNR_std = 10 log10(1 / 0.01) = 20 dB.
    # Paper space: offset 0.1/s, MSE = 0.01/s^2, range 1/s -> 10 log10((1/s^2)/(0.01/s^2)) = 20 dB.
    x01 = _smooth_images(2, 1) * 0.5  # within [0.05, 0.45] so +0.1 never clamps
    out = M.image_metrics(
        _normalize(x01, MNIST_MEAN, MNIST_STD),
        _normalize(x01 + 0.1, MNIST_MEAN, MNIST_STD),
        MNIST_MEAN,
        MNIST_STD,
    )
    assert torch.allclose(out["psnr_std"], torch.full((2,), 20.0), atol=1e-3)
    assert torch.allclose(out["psnr_paper"], torch.full((2,), 20.0), atol=1e-3)
    assert torch.allclose(out["mse_paper"], torch.full((2,), 0.01 / MNIST_STD[0] ** 2), rtol=1e-4)


def test_psnr_paper_space_three_channels():
    # Paper space with CIFAR: offset d in normalized units, range max(1/s) -> 10 log10(R^2 / d^2).
    x = torch.zeros(1, 3, 32, 32)
    d = 0.5
    out = M.image_metrics(x, x + d, CIFAR_MEAN, CIFAR_STD)
    expected = 10 * math.log10(M.data_range_paper(CIFAR_STD) ** 2 / d**2)
    assert out["psnr_paper"].item() == pytest.approx(expected, abs=1e-3)


# --- matching ------------------------------------------------------------------------------


def test_hungarian_recovers_permutation():
    x = _normalize(_smooth_images(5, 1), MNIST_MEAN, MNIST_STD)
    true_perm = torch.tensor([3, 0, 4, 1, 2])
    recons = x[true_perm] + 0.01 * torch.randn_like(x)
    perm = M.match_reconstructions(x, recons)
    # recons[perm][i] must be the (noisy) copy of x[i]
    assert torch.equal(true_perm[perm], torch.arange(5))


def test_hungarian_respects_labels():
    x = _normalize(_smooth_images(2, 1), MNIST_MEAN, MNIST_STD)
    recons = x[[1, 0]]  # swapped, but labels differ, so the swap must not be undone
    perm = M.match_reconstructions(x, recons, labels=torch.tensor([0, 1]))
    assert perm.tolist() == [0, 1]
    assert M.match_reconstructions(x, recons).tolist() == [1, 0]


def test_score_batch_matched_and_unmatched():
    x = _normalize(_smooth_images(3, 1), MNIST_MEAN, MNIST_STD)
    recons = x[[2, 0, 1]].clone()
    res = M.score_batch(x, recons, MNIST_MEAN, MNIST_STD)
    assert res["matched"] is True
    assert res["lpips_available"] is False and res["metrics"]["lpips"] is None
    assert res["metrics"]["mse_paper"]["mean"] == 0.0
    assert res["metrics"]["ssim_std"]["mean"] == pytest.approx(1.0)
    assert res["unmatched_metrics"]["mse_paper"]["mean"] > 0
    assert len(res["metrics"]["ssim_paper"]["per_image"]) == 3
    assert set(res["metrics"]) == set(M.IMAGE_METRICS) | {"lpips"}

    res = M.score_batch(x, recons, MNIST_MEAN, MNIST_STD, match=False)
    assert res["matched"] is False and res["unmatched_metrics"] is None
    assert res["permutation"] == [0, 1, 2]
    assert res["metrics"]["mse_paper"]["mean"] > 0


# --- aggregation ---------------------------------------------------------------------------


def test_summarize():
    assert M.summarize([1.0, 3.0, float("nan")]) == (2.0, 1.0)
    m, s = M.summarize([float("nan")])
    assert math.isnan(m) and math.isnan(s)
    m, s = M.summarize(torch.tensor([float("inf"), 1.0]))
    assert m == float("inf") and math.isnan(s)


# --- masks ---------------------------------------------------------------------------------


def test_mask_metrics_known_values():
    learned = [torch.ones(4, 4), torch.ones(10)]
    true = [torch.cat([torch.zeros(8), torch.ones(8)]).view(4, 4), torch.cat([torch.zeros(5), torch.ones(5)])]
    assert M.mean_mask_distance(learned, true) == pytest.approx(0.5)
    # learned all ones: 1 - mean = 0 dropped, so TRD = p.
    assert M.throughput_rate_distance(learned, 0.25) == pytest.approx(0.25)
    # means 0.75 and 0.5 -> dropped 0.25 and 0.5 -> |0.25-0.25|, |0.25-0.5| -> mean 0.125
    learned2 = [torch.full((4,), 0.75), torch.tensor([0.0, 1.0])]
    assert M.throughput_rate_distance(learned2, 0.25) == pytest.approx(0.125)
    # MMD per layer: (0.75-0)^2.. layer1 true all ones -> 0.0625; layer2 exact -> 0
    assert M.mean_mask_distance(learned2, [torch.ones(4), torch.tensor([0.0, 1.0])]) == pytest.approx(0.03125)
    assert M.mask_metrics(learned, true, 0.25) == pytest.approx({"mmd": 0.5, "trd": 0.25})
    with pytest.raises(ValueError):
        M.mean_mask_distance([torch.ones(3)], [torch.ones(4)])


# --- LPIPS ---------------------------------------------------------------------------------


def test_checkpoint_names_match_torchvision():
    from torchvision.models import AlexNet_Weights, SqueezeNet1_1_Weights, VGG16_Weights

    for net, w in (("alex", AlexNet_Weights), ("squeeze", SqueezeNet1_1_Weights), ("vgg", VGG16_Weights)):
        assert M.backbone_checkpoint_path(net).name == w.IMAGENET1K_V1.url.rsplit("/", 1)[-1]


@pytest.mark.parametrize("allow_download", [False, True])
def test_lpips_unavailable(empty_torch_home, no_network, caplog, allow_download):
    x = _normalize(_smooth_images(2, 1), MNIST_MEAN, MNIST_STD)
    with caplog.at_level(logging.WARNING, logger=M.__name__):
        scorers = [M.LpipsScorer(allow_download=allow_download, download_timeout=0.5) for _ in range(2)]
        results = [M.score_batch(x, x.clone(), MNIST_MEAN, MNIST_STD, lpips_scorer=s) for s in scorers]
        direct = scorers[0](torch.rand(1, 1, 28, 28), torch.rand(1, 1, 28, 28))
    assert direct is None
    for r in results:
        assert r["metrics"]["lpips"] is None and r["lpips_available"] is False
        assert r["metrics"]["ssim_paper"]["mean"] == pytest.approx(1.0)  # the rest still computed
    warnings_ = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings_) == 1
    msg = warnings_[0].getMessage()
    assert msg.startswith("LPIPS unavailable") and "alexnet-owt-7be5be79.pth" in msg
    assert scorers[1].unavailable_reason is not None and not scorers[1].available
    # Downloads disallowed: the network is never touched; allowed: tried (and failed fast).
    assert (len(no_network) > 0) == allow_download
    assert not list(empty_torch_home.rglob("*.partial"))


@pytest.mark.parametrize("net", ["alex", "squeeze", "vgg"])
def test_lpips_random_backbone(net, no_network):
    torch.manual_seed(0)
    scorer = M.LpipsScorer(net=net, backbone_weights="random")
    assert scorer.available
    x = _smooth_images(2, 1)  # grayscale 28 px: repeated to RGB and upsampled to 32 px
    same = scorer(x, x.clone())
    diff = scorer(x, torch.roll(x, 3, dims=-1))
    assert same is not None and diff is not None and same.shape == (2,)
    assert torch.allclose(same, torch.zeros(2), atol=1e-6)
    assert torch.all(torch.isfinite(diff)) and torch.all(diff > 0)
    assert no_network == []


def test_lpips_in_score_batch_with_random_backbone():
    torch.manual_seed(0)
    scorer = M.LpipsScorer(net="squeeze", backbone_weights="random")
    x = _normalize(_smooth_images(3, 3, size=32), CIFAR_MEAN, CIFAR_STD)
    res = M.score_batch(x, x[[1, 2, 0]], CIFAR_MEAN, CIFAR_STD, lpips_scorer=scorer)
    assert res["lpips_available"]
    assert res["metrics"]["lpips"]["mean"] == pytest.approx(0.0, abs=1e-6)
    assert res["unmatched_metrics"]["lpips"]["mean"] > 0


def test_lpips_uses_cached_checkpoint_without_download(empty_torch_home, no_network):
    # A squeezenet state dict (random, 5 MB) stands in for the cached ImageNet file.
    from torchvision.models import squeezenet1_1

    torch.manual_seed(0)
    path = M.backbone_checkpoint_path("squeeze")
    path.parent.mkdir(parents=True)
    ref = squeezenet1_1(weights=None)
    torch.save(ref.state_dict(), path)
    scorer = M.LpipsScorer(net="squeeze", allow_download=False)
    assert scorer.available and no_network == []
    # The backbone really carries the file's weights.
    first_conv = scorer._model.net.slice1[0].weight
    assert torch.equal(first_conv, ref.features[0].weight)
    x = _smooth_images(2, 1)
    assert torch.allclose(scorer(x, x), torch.zeros(2), atol=1e-6)


def test_lpips_corrupt_checkpoint_is_unavailable(empty_torch_home, no_network, caplog):
    path = M.backbone_checkpoint_path("squeeze")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger=M.__name__):
        scorer = M.LpipsScorer(net="squeeze")
        assert scorer(torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32)) is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert no_network == []


def test_dns_lookup_is_bounded(monkeypatch):
    # A resolver that hangs must not hang the scorer: the probe before a download gives up after the timeout.
    # The resolver stalls for a minute: a probe that waited for it takes a minute, one that gave up at
    # its 0.2 s deadline well under the bound, however busy the machine (other test workers included).
    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: release.wait(60))
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            M.probe_url("https://download.pytorch.org/models/alexnet-owt-7be5be79.pth", 0.2)
        assert time.monotonic() - start < 20
    finally:
        release.set()


@pytest.mark.parametrize("good_hash", [True, False])
def test_download_checks_hash_and_is_atomic(tmp_path, monkeypatch, good_hash):
    payload = b"fake weights"
    prefix = hashlib.sha256(payload).hexdigest()[:8] if good_hash else "deadbeef"
    dest = tmp_path / f"net-{prefix}.pth"
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(payload))
    if good_hash:
        M._download("https://example.invalid/x.pth", dest, timeout=1.0)
        assert dest.read_bytes() == payload
    else:
        with pytest.raises(ValueError, match="checksum"):
            M._download("https://example.invalid/x.pth", dest, timeout=1.0)
        assert not dest.exists()
    assert not list(tmp_path.glob("*.partial"))


def test_minmax_ssim_is_the_third_labelled_space(mnist_like) -> None:
    """SSIM after scaling each image to [0, 1] by its own min and max: 1 for a reconstruction that is
    the original up to brightness and contrast (which the other two spaces penalize), and equal to the
    [0,1] space's SSIM when both images already span exactly [0, 1]."""
    images, _ = mnist_like
    mean, std = (0.13066373765468597,), (0.30810782313346863,)
    shifted = 0.5 * images + 0.7  # dimmer and brighter, same structure
    m = M.image_metrics(images, shifted, mean, std)
    assert torch.allclose(m["ssim_minmax"], torch.ones(4), atol=1e-5)
    assert (m["ssim_std"] < 0.99).all() and (m["ssim_paper"] < 0.99).all()
    noisy = images + 0.3 * torch.randn_like(images)
    noisy = noisy.clamp(images.min(), images.max())
    noisy[:, :, 0, 0], noisy[:, :, 0, 1] = images.min(), images.max()  # spans the same [0, 1] as the original
    m = M.image_metrics(images, noisy, mean, std)
    assert torch.allclose(m["ssim_minmax"], m["ssim_std"], atol=1e-5)
