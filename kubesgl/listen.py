"""The listening socket of a server (`kubesgl serve`, `kubesgl router`), bound before anything
else starts, so that a port in use is refused at once with one line naming the flag to change,
instead of after the model loads or the workers are found."""

from __future__ import annotations

import errno
import socket

BACKLOG = 2048  # uvicorn's


class CannotListen(ValueError):
    """The address cannot be listened on; the message is one line naming the flag to change."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, for uvicorn to serve. Listening, not only bound: only a
    listening socket keeps a second server off the port. Its family is the one uvicorn's own
    socket takes (uvicorn.Config.bind_socket): IPv6 where the host has a ':', else IPv4, so that
    a name such as localhost, which may resolve to ::1 first, means 127.0.0.1, and an empty
    host every IPv4 address, as 0.0.0.0 does."""
    sock = bound_socket(host, port, "--port")
    try:
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise CannotListen(bind_problem(f"--port {port}", host, port, exc)) from None
    return sock


def bound_socket(host: str, port: int, flag: str) -> socket.socket:
    """A socket bound to host:port in uvicorn's family (listen_socket); CannotListen names
    `flag`, the port's, or --host."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as exc:  # its errno is no errno value: EAI_NONAME is -2
        sock.close()
        raise CannotListen(
            f"--host {host}: not an address of this machine ({exc.strerror})"
        ) from None
    except OSError as exc:
        sock.close()
        raise CannotListen(bind_problem(f"{flag} {port}", host, port, exc)) from None
    return sock


def bind_problem(what: str, host: str, port: int, exc: OSError) -> str:
    """Why binding host:port failed, naming the flag `what` to change."""
    if exc.errno == errno.EADDRINUSE:
        return f"{what}: port {port} on {host} is already in use (another server?); choose another port"
    if exc.errno == errno.EACCES:
        return f"{what}: not allowed to listen on port {port} (ports below 1024 need privileges)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    return f"{what}: cannot listen on {host}:{port}: {exc.strerror}"
