"""Test hosts: Linux network namespaces on one private subnet, joined by veth pairs and a bridge.

`Hosts.create(["control", "prefill", "decode"])` makes, for this test run only (names carry a random tag,
so several runs on one machine never meet):

- a bridge `pdb<tag>` in the root namespace, address `<subnet>.1/24`: the test process's side of the
  subnet (it is the client of the gateway, and relays Postgres, see `tests/hosts/relay.py`);
- per host a namespace `pds<tag>-<name>` whose `eth0` (one end of a veth pair, the other end `pdv<tag><i>`
  on the bridge) has `<subnet>.<2+i>/24`, and `lo` up. Nothing routes the subnet anywhere else: its traffic
  stays between the namespaces this run made and the bridge.

`Host.popen(cmd)` runs a process inside a host (`ip netns exec`); `Host.cut_link()` / `restore_link()`
take its cable out and put it back (`ip link set pdv<tag><i> down|up`, the bridge side, so the host keeps
its own address); `Host.set_delay_ms(d)` delays every packet leaving the host by d ms (one-way host to
host = d, a round trip 2d): with `tc qdisc … netem` where the kernel has it, else (this machine's kernel is
built without CONFIG_NET_SCH_NETEM) with an iptables rule that queues the host's outgoing packets to
`tests/hosts/delay.py`, which holds each for d ms (NFQUEUE). `Hosts.destroy()` (also at interpreter exit and
for the leftovers of a run whose process died) kills every process in the namespaces, deletes them (their
veth pairs go with them) and the bridge.

Needs root and iproute2 (`ip`, `tc`); the delay fallback needs iptables (`make host-tools`, run by
`.ci/run`) and the `fnfqueue` wheel (dev extras). `unavailable()` says why hosts cannot be made here, or "".
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

STATE_DIR = Path("/run/pdserve-hosts")  # one file per live run: its tag → the pid that owns it
ROOT = Path(__file__).resolve().parents[2]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def unavailable() -> str:
    """Why network-namespace hosts cannot be made on this machine, or "" when they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "test hosts are network namespaces: they need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed: `make host-tools` installs it"
    probe = f"pdsprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (tried on a throwaway namespace's loopback)."""
    probe = f"pdsnetem{os.getpid()}"
    _ip("netns", "add", probe)
    try:
        _ip("-n", probe, "link", "set", "lo", "up")
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True)
        return r.returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


def _pick_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.64.0.0/10 that no interface or route of the root namespace uses."""
    used = _ip("-4", "-o", "addr").stdout + _ip("-4", "route").stdout
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.{random.randint(64, 127)}.{random.randint(0, 255)}.0/24")
        if f"{'.'.join(str(net.network_address).split('.')[:3])}." not in used:
            return net
    raise RuntimeError("no free /24 in 10.64.0.0/10")


@dataclass
class Host:
    """One test host: a network namespace with one address on the run's subnet."""

    name: str
    netns: str
    address: str  # its eth0 address, e.g. "10.77.12.2"
    link: str  # the bridge side of its veth pair (what `cut_link` takes down)
    delay_ms: float = 0.0
    procs: list[subprocess.Popen] = field(default_factory=list)
    _delayer: subprocess.Popen | None = None

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside this host (its pid is the command's: `ip netns exec` execs it)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *cmd], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """Run `cmd` inside this host to its end (stdout, stderr captured as text)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *cmd], check=check, capture_output=True,
                              text=True)

    def cut_link(self) -> None:
        """Take the host's cable out: its bridge-side veth goes down, nothing crosses until `restore_link`."""
        _ip("link", "set", self.link, "down")

    def restore_link(self) -> None:
        _ip("link", "set", self.link, "up")

    def set_delay_ms(self, delay_ms: float) -> None:
        """Delay every packet leaving this host by `delay_ms` (0 removes the delay)."""
        self._clear_delay()
        self.delay_ms = delay_ms
        if delay_ms <= 0:
            return
        if netem_available():
            self.run(["tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", f"{delay_ms}ms"])
            return
        # NFQUEUE (an iptables target: this kernel has the xtables one, not nftables' `queue`); the queue
        # is per network namespace, so 0 is this host's own.
        self._delayer = self.popen([sys.executable, "-m", "tests.hosts.delay", "--delay-ms", str(delay_ms),
                                    "--queue", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if self._delayer.stdout.readline().strip() != "bound":  # queue bound before packets go to it
            raise RuntimeError(f"delayer on {self.name} did not start")
        self.run(["iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", "0"])

    def _clear_delay(self) -> None:
        self.run(["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        if shutil.which("iptables"):
            self.run(["iptables", "-F", "OUTPUT"], check=False)
        if self._delayer is not None:
            _stop(self._delayer)
            self._delayer = None
        self.delay_ms = 0.0


def _stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Hosts:
    """The hosts of one test run on their private subnet; `destroy()` removes everything `create` made."""

    def __init__(self, tag: str, subnet: ipaddress.IPv4Network) -> None:
        self.tag = tag
        self.subnet = subnet
        self.bridge = f"pdb{tag}"
        hosts = list(subnet.hosts())
        self.gateway_address = str(hosts[0])  # the bridge's: the root namespace's side
        self._next = 1
        self.hosts: dict[str, Host] = {}
        self._state = STATE_DIR / tag

    @classmethod
    def create(cls, names: list[str]) -> Hosts:
        """Make the bridge and one host per name. Raises subprocess.CalledProcessError when `ip` refuses
        (whatever was made is destroyed first)."""
        sweep_leftovers()
        self = cls(uuid.uuid4().hex[:5], _pick_subnet())
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state.write_text(str(os.getpid()))
        atexit.register(self.destroy)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in names:
                self.add(name)
        except BaseException:
            self.destroy()
            raise
        return self

    def add(self, name: str) -> Host:
        i = self._next
        self._next += 1
        address = str(list(self.subnet.hosts())[i])
        host = Host(name, f"pds{self.tag}-{name}", address, f"pdv{self.tag}{i}")
        _ip("netns", "add", host.netns)
        self.hosts[name] = host
        _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        _ip("-n", host.netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        return host

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self):
        return iter(self.hosts.values())

    def set_delay_ms(self, delay_ms: float) -> None:
        """Every host's outgoing packets delayed by `delay_ms`: host to host one-way `delay_ms`."""
        for host in self:
            host.set_delay_ms(delay_ms)

    def destroy(self) -> None:
        """Stop every process in the hosts, delete the namespaces and the bridge. Idempotent."""
        for host in self.hosts.values():
            for proc in host.procs:
                _stop(proc)
        for host in self.hosts.values():
            _remove_netns(host.netns)
        self.hosts.clear()
        _ip("link", "del", self.bridge, check=False)
        self._state.unlink(missing_ok=True)


def _remove_netns(netns: str) -> None:
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    for pid in pids:
        try:
            psutil.Process(int(pid)).wait(5)
        except (psutil.Error, ValueError):
            pass
    _ip("netns", "del", netns, check=False)


def sweep_leftovers() -> None:
    """Remove the hosts of runs whose owning process is gone (killed before its teardown ran)."""
    if not STATE_DIR.exists():
        return
    for state in STATE_DIR.iterdir():
        try:
            alive = psutil.pid_exists(int(state.read_text()))
        except (OSError, ValueError):
            alive = False
        if alive:
            continue
        tag = state.name
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            if line.startswith(f"pds{tag}-"):
                _remove_netns(line.split()[0])
        _ip("link", "del", f"pdb{tag}", check=False)
        state.unlink(missing_ok=True)


def wait_tcp(host: Host, port: int, timeout_s: float = 15.0) -> None:
    """Until something accepts TCP on `host.address:port` (from the root namespace, over the bridge)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.address, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing accepts {host.address}:{port} on {host.name}")
