"""A network namespace joined to the host by one veth pair: the link the harness cuts or throttles.

The victim node runs inside the namespace and binds the inner address; the other nodes run
on the host and bind the host-side address, which stays a local address of the host even
while the link is down. Every byte between the victim and the swarm (DHT, gRPC, HTTP)
crosses that one link, so `cut()` is a real partition (packets vanish, no RST, exactly what
a peer behind a failed uplink looks like) and `throttle()` a real token-bucket rate limit
(tc tbf) in both directions. Needs root and iproute2; `available()` says whether this box
has them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

_counter = itertools.count()


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=10)


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


class IsolatedHost:
    def __init__(self) -> None:
        n = next(_counter)
        tag = f"{os.getpid() % 10000}x{n}"
        self.name = f"dtc{tag}"
        self.outer_dev, self.inner_dev = f"dto{tag}", f"dti{tag}"
        subnet = f"10.{200 + os.getpid() % 50}.{n % 250}"
        self.host_ip, self.inner_ip = f"{subnet}.1", f"{subnet}.2"
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.outer_dev, "type", "veth", "peer", "name", self.inner_dev)
            _ip("link", "set", self.inner_dev, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.outer_dev)
            _ip("link", "set", self.outer_dev, "up")
            _ip("addr", "add", f"{self.inner_ip}/24", "dev", self.inner_dev, netns=self.name)
            _ip("link", "set", "lo", "up", netns=self.name)
            _ip("link", "set", self.inner_dev, "up", netns=self.name)
        except BaseException:
            self.close()
            raise

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """Take the link down from the inside: the host keeps its address, the victim loses all."""
        _ip("link", "set", self.inner_dev, "down", netns=self.name)

    def restore(self) -> None:
        _ip("link", "set", self.inner_dev, "up", netns=self.name)

    def throttle(self, mbit: float) -> None:
        """Limit both directions of the link to `mbit` Mbit/s (tc tbf, replacing any limit)."""
        spec = ["root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "500ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.outer_dev, *spec], check=True, capture_output=True)
        subprocess.run(
            [*self.prefix, "tc", "qdisc", "replace", "dev", self.inner_dev, *spec], check=True, capture_output=True
        )

    def unthrottle(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.outer_dev, "root"], capture_output=True, check=False)
        subprocess.run(
            [*self.prefix, "tc", "qdisc", "del", "dev", self.inner_dev, "root"], capture_output=True, check=False
        )

    def close(self) -> None:
        """Delete the namespace (and with it the veth pair). Processes inside must be gone first."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.outer_dev], capture_output=True, check=False)  # if the move failed
