"""systemd notification protocol (sd_notify) over $NOTIFY_SOCKET, without libsystemd.

Outside systemd (no NOTIFY_SOCKET) every call is a no-op, so the agent runs the same everywhere.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = address
        self.sent = 0
        self.errors = 0
        self.withheld = 0
        """Watchdog pings not sent because a supervised thread was unhealthy."""
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def _target(self) -> str:
        # A leading '@' names an abstract-namespace socket.
        return "\0" + self.address[1:] if self.address.startswith("@") else self.address

    def notify(self, **fields: str | int) -> bool:
        if self._sock is None:
            return False
        payload = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(payload, self._target())
        except OSError:
            self.errors += 1
            return False
        self.sent += 1
        return True

    def ready(self, status: str) -> bool:
        return self.notify(ready=1, status=status, mainpid=os.getpid())

    def status(self, status: str) -> bool:
        return self.notify(status=status)

    def watchdog(self, healthy: bool = True) -> bool:
        """Feed the watchdog, only while ``healthy``: a withheld feed lets systemd restart the agent
        after WatchdogSec, which is the point when one of its threads died or hangs."""
        if not healthy:
            self.withheld += 1
            return False
        return self.notify(watchdog=1)

    def reloading(self) -> bool:
        return self.notify(reloading=1)

    def stopping(self) -> bool:
        return self.notify(stopping=1)

    @staticmethod
    def watchdog_interval_s() -> float | None:
        """Half of WATCHDOG_USEC (systemd's advice), or None when no watchdog is armed for us."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 2e6
        except ValueError:
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
