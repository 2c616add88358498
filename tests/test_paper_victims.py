"""The paper's victim files: fetched by URL with a pinned SHA-256 (served here from a loopback HTTP
server: these machines reach no other host), verified, stored atomically, refused in one line."""

from __future__ import annotations

import hashlib
import http.server
import io
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attacker.cli import main as attacker_main
from fedsim.cli import main as fedsim_main
from fedsim.data import load_victim_file, paper_victims_path
from fedsim.data import victim_sets as pv
from fedsim.data.datasets import VictimFileError

from .conftest import ROOT


class _Server:
    """A loopback HTTP server whose answers the test sets: (status, body, declared length, delay)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, bytes, int | None, float]] = {}
        self.requests: list[str] = []
        self.released = threading.Event()  # ends every delay (set when the test is done)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.requests.append(self.path)
                status, body, length, delay = server.routes.get(self.path, (404, b"not found", None, 0.0))
                server.released.wait(delay)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up first
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/files/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def serve(
        self, name: str, body: bytes, *, status: int = 200, length: int | None = None, delay: float = 0.0
    ) -> None:
        self.routes[f"/files/{name}"] = (status, body, length, delay)


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.released.set()
    s.httpd.shutdown()
    s.httpd.server_close()


def _victim_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"inputs": torch.randn(4, 1, 28, 28), "targets": torch.tensor([0, 1, 2, 3])}, buf)
    return buf.getvalue()


@pytest.fixture
def small_set(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The 'mnist' set pinned to a small file of this test's (the real files are not in the repository)."""
    body = _victim_bytes()
    pinned = pv.VictimSet("mnist", "MNIST_128.tdump", hashlib.sha256(body).hexdigest(), (4, 1, 28, 28))
    monkeypatch.setitem(pv.PAPER_VICTIMS, "mnist", pinned)
    return body


def _left_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


def test_fetched_once_verified_and_loaded(server: _Server, small_set: bytes, tmp_path: Path) -> None:
    server.serve("MNIST_128.tdump", small_set)
    path = pv.paper_victims("mnist", tmp_path, allow_download=True, base_url=server.url)
    assert path == paper_victims_path("mnist", tmp_path) and path.read_bytes() == small_set
    inputs, targets = load_victim_file(path)
    assert tuple(inputs.shape) == (4, 1, 28, 28) and targets.tolist() == [0, 1, 2, 3]
    assert pv.paper_victims("mnist", tmp_path, allow_download=True, base_url=server.url) == path
    assert server.requests == ["/files/MNIST_128.tdump"]  # the second call used the verified file
    assert _left_in(tmp_path) == ["MNIST_128.tdump", "dia-victims"]


def test_the_mirror_variable_points_the_fetch(
    server: _Server, small_set: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.serve("MNIST_128.tdump", small_set)
    monkeypatch.setenv(pv.URL_ENV, server.url)
    assert pv.paper_victims("mnist", tmp_path, allow_download=True).read_bytes() == small_set


@pytest.mark.parametrize("case", ["wrong-bytes", "partial", "http-404", "stalled"])
def test_a_failed_fetch_is_one_line_and_leaves_nothing(
    case: str, server: _Server, small_set: bytes, tmp_path: Path
) -> None:
    name = "MNIST_128.tdump"
    if case == "wrong-bytes":
        server.serve(name, small_set[:-1] + b"x")
    elif case == "partial":
        server.serve(name, small_set[: len(small_set) // 2], length=len(small_set))
    elif case == "stalled":
        server.serve(name, small_set, delay=60.0)
    start = time.monotonic()
    with pytest.raises(VictimFileError) as info:
        pv.paper_victims("mnist", tmp_path, allow_download=True, base_url=server.url, timeout_s=0.5)
    message = str(info.value)
    # A fetch that waited for the stalled server would take its minute; one that gave up at the 0.5 s
    # deadline (or failed at once) stays well under the bound, even on a machine busy with other work.
    assert "\n" not in message and time.monotonic() - start < 20
    expected = {
        "wrong-bytes": [pv.PAPER_VICTIMS["mnist"].sha256],
        "partial": ["partial download"],
        "http-404": ["404"],
        "stalled": ["within 0.5 s", "timed out"],
    }[case]  # the deadline or the socket's
    assert any(e in message for e in expected), message
    assert server.url + name in message  # the URL that failed
    if case == "wrong-bytes":
        assert hashlib.sha256(small_set[:-1] + b"x").hexdigest() in message  # and the hash found
    else:
        assert "make victims" in message  # and how to get the file
    assert _left_in(tmp_path / "dia-victims") == []


def test_downloads_off_asks_nothing_and_says_how(
    server: _Server, small_set: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.serve("MNIST_128.tdump", small_set)
    monkeypatch.setenv(pv.OFFLINE_ENV, "1")
    with pytest.raises(VictimFileError, match=r"not there and downloads are off .*make victims.*sha256") as info:
        pv.paper_victims("mnist", tmp_path, base_url=server.url)
    assert str(paper_victims_path("mnist", tmp_path)) in str(info.value)
    assert server.requests == []


def test_a_file_there_that_is_not_the_papers_is_refused(small_set: bytes, tmp_path: Path) -> None:
    path = paper_victims_path("mnist", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"something else")
    with pytest.raises(VictimFileError) as info:
        pv.paper_victims("mnist", tmp_path, allow_download=False)
    message = str(info.value)
    assert str(path) in message and pv.PAPER_VICTIMS["mnist"].sha256 in message
    assert hashlib.sha256(b"something else").hexdigest() in message and "delete it" in message


def test_fedsim_victims_the_make_target(
    server: _Server, small_set: bytes, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    server.serve("MNIST_128.tdump", small_set)  # no CIFAR-10 file on this server: a 404
    assert fedsim_main(["victims", "--data-root", str(tmp_path), "--url", server.url]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("mnist: ") and "sha256 verified" in line for line in lines)
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "CIFAR10_128.tdump" in errors[0] and "404" in errors[0]
    assert fedsim_main(["victims", "--data-root", str(tmp_path), "--url", server.url, "--datasets", "mnist"]) == 0
    assert fedsim_main(["victims", "--data-root", str(tmp_path), "--datasets", "imagenet"]) == 2
    assert "no victim set for dataset 'imagenet'" in capsys.readouterr().out


def test_attacker_run_with_paper_victims_fetches_them(
    server: _Server, small_set: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    server.serve("MNIST_128.tdump", small_set)
    monkeypatch.setenv(pv.URL_ENV, server.url)
    monkeypatch.delenv(pv.OFFLINE_ENV)
    args = [
        "run",
        "--paper-victims",
        "--data-root",
        str(tmp_path / "data"),
        "--model",
        "mlp",
        "--dataset",
        "mnist",
        "--victims",
        "2",
        "--attacks",
        "dia",
        "--iterations",
        "2",
        "--no-lpips",
        "--quiet",
    ]
    assert attacker_main([*args, "--out", str(tmp_path / "run")]) == 0
    assert "fetching the paper's mnist victims" in capsys.readouterr().out
    assert (tmp_path / "run" / "metrics.json").is_file()
    server.routes.clear()  # gone from the network: the stored file still serves
    assert attacker_main([*args, "--out", str(tmp_path / "again")]) == 0


def test_commands_without_the_victims_say_so_in_one_line(tmp_path: Path) -> None:
    """As typed, offline (the tests set DLA_OFFLINE=1): exit 2, one line, no traceback, no run folder."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from attacker.cli import main; sys.exit(main())",
        "run",
        "--paper-victims",
        "--data-root",
        str(tmp_path / "data"),
        "--out",
        str(out),
        "--quiet",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    text = done.stdout + done.stderr
    assert done.returncode == 2, text
    assert "Traceback" not in text and "make victims" in text and "MNIST_128.tdump" in text
    assert not out.exists()
    bad_url = [
        sys.executable,
        "-c",
        "import sys; from fedsim.cli import main; sys.exit(main())",
        "victims",
        "--data-root",
        str(tmp_path / "data"),
        "--url",
        "http://127.0.0.1:9/",
        "--timeout",
        "2",
    ]
    done = subprocess.run(bad_url, capture_output=True, text=True, timeout=60, cwd=tmp_path)  # port 9: nobody
    text = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "http://127.0.0.1:9/MNIST_128.tdump" in text
    assert _left_in(tmp_path / "data" / "dia-victims") == []


def test_the_real_files_match_their_pins(server: _Server, tmp_path: Path) -> None:
    """Where `make victims` (or CI) put the real files, serving them fetches them back verified."""
    for dataset, s in pv.PAPER_VICTIMS.items():
        local = paper_victims_path(dataset, ROOT / "data")
        if not local.is_file():
            pytest.skip(f"the paper's victims are not in {local.parent} (run `make victims`)")
        server.serve(s.filename, local.read_bytes())
        fetched = pv.fetch_paper_victims(dataset, tmp_path, base_url=server.url)
        assert hashlib.sha256(fetched.read_bytes()).hexdigest() == s.sha256
        assert tuple(load_victim_file(fetched)[0].shape) == s.shape
