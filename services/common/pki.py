"""A deployment's TLS material, made with the ``openssl`` command (in every Debian image: the
``ca-certificates`` package depends on it): one CA and one node certificate that every Gyre
service presents (server auth) and may present as a client (mTLS, off by default: the per-role
tokens say who calls).

The node certificate names every host a client may dial: ``localhost``, ``127.0.0.1``, the
docker-compose service names (deploy/docker-compose.yml) and whatever the operator adds with
``gyre credentials DIR --host NAME_OR_IP`` (the systemd hosts' addresses). A host added later needs
a new node certificate: ``gyre credentials DIR --force --host ...`` (new tokens too).
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

# the hosts a compose deployment's clients dial (deploy/docker-compose.yml's service names)
COMPOSE_HOSTS = ("trajectory", "reward", "trainer", "engine-1", "engine-2", "gateway", "scheduler",
                 "cell-0", "cell-1", "cell-2")
DAYS = 825  # the longest validity browsers accept for a server certificate


def _alt_name(host: str) -> str:
    try:
        return f"IP:{ipaddress.ip_address(host)}"
    except ValueError:
        if not host or any(c.isspace() or c in ",=/" for c in host):
            raise ValueError(f"--host {host!r} is neither an IP address nor a DNS name") from None
        return f"DNS:{host}"


def subject_alt_names(hosts: Iterable[str]) -> list[str]:
    """The node certificate's SANs: localhost, 127.0.0.1, the compose names and ``hosts`` (no repeats)."""
    names: list[str] = []
    for host in ("localhost", "127.0.0.1", *COMPOSE_HOSTS, *hosts):
        alt = _alt_name(host.strip())
        if alt not in names:
            names.append(alt)
    return names


def make_tls(hosts: Iterable[str]) -> dict[str, bytes]:
    """PEM bytes of ``ca.pem``, ``ca.key``, ``node.pem`` and ``node.key`` (ECDSA P-256, SHA-256:
    as strong as RSA 3072, and its handshakes cost a fraction of the CPU, which a loaded two-core
    host running a dozen services notices)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ValueError("the openssl command is missing (Debian package openssl): it makes the TLS certificates")
    sans = subject_alt_names(hosts)

    def run(*args: str, cwd: str) -> None:
        proc = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ValueError(f"openssl {args[0]} failed: {proc.stderr.strip()[-300:]}")

    with tempfile.TemporaryDirectory(prefix="gyre-pki-") as d:
        Path(d, "ca.ext").write_text("basicConstraints=critical,CA:TRUE,pathlen:0\n"
                                     "keyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n")
        Path(d, "node.ext").write_text("basicConstraints=critical,CA:FALSE\n"
                                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n"
                                       f"subjectAltName={','.join(sans)}\n")
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")
        run("req", "-new", *ec, "-nodes", "-keyout", "ca.key", "-out", "ca.csr",
            "-subj", "/O=Gyre/CN=Gyre deployment CA", cwd=d)
        run("x509", "-req", "-in", "ca.csr", "-signkey", "ca.key", "-out", "ca.pem", "-days", str(DAYS),
            "-sha256", "-extfile", "ca.ext", cwd=d)
        run("req", "-new", *ec, "-nodes", "-keyout", "node.key", "-out", "node.csr",
            "-subj", "/O=Gyre/CN=gyre-node", cwd=d)
        run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "node.pem", "-days", str(DAYS), "-sha256", "-extfile", "node.ext", cwd=d)
        return {name: Path(d, name).read_bytes() for name in ("ca.pem", "ca.key", "node.pem", "node.key")}
