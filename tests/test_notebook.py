"""The walkthrough notebook runs top to bottom on the offline sample."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "walkthrough.ipynb"


def _kernel_or_skip() -> str:
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[dev]')")
    pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[dev]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed: no Python kernel to run the notebook")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no 'python3' Jupyter kernel is available")
    return nbformat.__name__


def test_walkthrough_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_or_skip()
    # 100 of the 300 iterations (the kernel inherits the environment): the ordering below is already
    # wide there (SSIM about 0.38 for IG against 0.99 for WIIG and DIA on the 2-core machine).
    monkeypatch.setenv("WALKTHROUGH_ITERATIONS", "100")
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "captured: True" in text  # round 2 was a capture round
    ssim = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if "SSIM (paper space)" in line}
    assert set(ssim) == {"ig_eval", "wiig", "dia"}
    assert (
        ssim["wiig"] > ssim["ig_eval"] and ssim["dia"] > ssim["ig_eval"]
    )  # the notebook's point, even at 100 iterations
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the reconstruction grid and the loss curves


def test_privacy_utility_notebook_executes_on_a_tiny_frontier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of its four tiny defended federations (none and central DP: the table's row without a
    guarantee and one with ε from Flower's accountant), attacked and tabulated, the comparison with no
    defense and the frontier figure. The other two defenses: their federations in tests/test_defenses.py,
    their ε and frontier columns in tests/test_frontier.py."""
    _kernel_or_skip()
    # 30 of the 150 attack iterations per cell (the kernel inherits the environment): the checks
    # below are the table's rows, ε and the figure, none of them the SSIM the iterations buy.
    monkeypatch.setenv("FRONTIER_ITERATIONS", "30")
    monkeypatch.setenv("FRONTIER_CELLS", "mlp-mnist-p0.25-none,mlp-mnist-p0.25-cdp-z0.1")
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / "privacy_utility.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "2 cells run" in text and "frontier figure: True" in text
    rows = {
        (line.split()[0], line.split()[1]): line
        for line in text.splitlines()
        if " accuracy " in line and " epsilon " in line
    }
    assert {d for d, _ in rows} == {"none", "central-dp-server-clipping"}
    epsilon = {d: line.split("epsilon")[-1].strip() for (d, _), line in rows.items()}
    assert epsilon["none"] == "–"  # no noise, no guarantee
    assert float(epsilon["central-dp-server-clipping"]) > 0
    assert "DIA SSIM" in text and "against no defense" in text  # the last cell: central DP against none
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the frontier
