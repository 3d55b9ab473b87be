"""A throwaway PKI made with openssl for TLS/mTLS tests: a CA, a node certificate (server and
client, SANs localhost/127.0.0.1), a harness client certificate and a self-signed rogue one."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """Write ca.pem/key, node.pem/key, client.pem/key (CA-signed) and rogue.pem/key (self-signed)."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=gyre-test-ca", cwd=d)
    for name in ("node", "client", "rogue"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        if name == "rogue":
            _openssl("x509", "-req", "-in", "rogue.csr", "-signkey", "rogue.key", "-out", "rogue.pem", "-days", "1",
                     "-extfile", "rogue.ext", cwd=d)
        else:
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                     "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d
