"""The throwaway TLS material of a loopback deployment passes strict X.509 checking (what Python 3.13's default
context does: the SuperLink's health check and Flower's clients verify the chain), in a real handshake."""

from __future__ import annotations

import socket
import ssl
import threading

from federated.tls import make_tls


def test_the_servers_chain_passes_a_strict_handshake_on_loopback(tmp_path):
    paths = make_tls(tmp_path / "tls")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(paths["cert"], paths["key"])
    client = ssl.create_default_context(cafile=str(paths["ca"]))
    client.verify_flags |= ssl.VERIFY_X509_STRICT  # Python 3.13's default; set here for every Python
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        accepted: list[bytes] = []

        def serve() -> None:
            connection, _ = listener.accept()
            with server.wrap_socket(connection, server_side=True) as tls:
                accepted.append(tls.recv(5))

        thread = threading.Thread(target=serve)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as raw:
            with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"hello")
        thread.join()
    assert accepted == [b"hello"]
