"""Attach this terminal to a rank's ``vescale.debug.breakpoint`` (the command the rank printed):

    python -m vescale.debug.attach 127.0.0.1:PORT --token TOKEN

Lines typed here go to the rank's pdb, its answers come back; the client exits when the rank
continues (or closes the connection). Ctrl-D detaches and leaves the rank waiting for a new attach.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from typing import Sequence


def _print_replies(conn: socket.socket) -> None:
    while True:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            sys.stdout.write("\n[vescale.debug.attach: the rank closed the session]\n")
            sys.stdout.flush()
            os._exit(0)  # the main thread may be blocked reading the keyboard
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", help="HOST:PORT printed by the rank")
    parser.add_argument("--token", required=True, help="the token printed by the rank")
    args = parser.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"address {args.address!r} is not HOST:PORT; copy it from the line the rank printed")
    try:
        conn = socket.create_connection((host, int(port)))
    except OSError as e:
        raise SystemExit(f"cannot connect to {args.address}: {e} (has the rank already continued?)") from None
    conn.sendall(args.token.encode() + b"\n")
    threading.Thread(target=_print_replies, args=(conn,), daemon=True).start()
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    try:
        while True:
            conn.sendall((input() + "\n").encode())
    except (EOFError, KeyboardInterrupt):
        print("\n[detached; the rank keeps waiting: attach again with the same command]")
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
