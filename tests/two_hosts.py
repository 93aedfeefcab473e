"""Two emulated hosts on one machine, for MPI tests that cross a network link.

    python tests/two_hosts.py up DIR     make the hosts; prints the mpiexec line to use
    python tests/two_hosts.py down DIR   remove them

Each host is a network namespace with a veth to a bridge in the root namespace (the bridge has
10.231.x.1, the hosts .2 and .3, a /24 of the private range made only for this), its own
hostname and IPC namespace, and its own mount namespace with a private /dev/shm (so the ranks
of two hosts cannot meet in shared memory: their bytes cross the veths) and a private
``DIR/local`` (a node-local disk: what one host writes there the other does not see).
No PID namespace: UCX breaks in one, and the tests find every rank from the root namespace.

MPICH's hydra starts its proxies through the ssh launcher; ``DIR/launcher`` stands in for
ssh: hydra calls ``launcher -x HOST '"path/hydra_pmi_proxy"' ARGS...``, and the wrapper joins
the words and runs them with ``sh -c`` inside HOST's namespaces (``nsenter``), as ssh would.
Use ``mpiexec -launcher ssh -launcher-exec DIR/launcher -iface BRIDGE -hosts ADDR1,ADDR2``.
Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TwoHosts", "missing_reason"]

_SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check,
                          env={**os.environ, "PATH": _SBIN})


def missing_reason() -> str | None:
    """Why two hosts cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root; CI runs the tests as root"
    lacking = [t for t in ("ip", "unshare", "nsenter") if shutil.which(t, path=_SBIN) is None]
    if lacking:
        return f"no {', '.join(lacking)} here (apt-get install iproute2 util-linux)"
    name = f"rlxprobe{os.getpid() % 100000}"
    p = _ip("netns", "add", name, check=False)
    if p.returncode != 0:
        return f"network namespaces are not permitted here (ip netns add: {p.stderr.strip()})"
    _ip("netns", "del", name, check=False)
    p = subprocess.run(["unshare", "--uts", "--ipc", "--mount", "true"], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        return f"unshare --uts --ipc --mount is not permitted here: {p.stderr.strip()}"
    return None


@dataclass
class TwoHosts:
    """Hosts ``names`` at 10.231.<subnet>.2, .3 ... behind bridge ``bridge`` (10.231.<subnet>.1)."""

    dir: Path
    names: tuple[str, ...] = ("h1", "h2")
    tag: str = field(default_factory=lambda: str(os.getpid() % 10000))
    holders: dict = field(default_factory=dict)  # host name -> pid of a process in its namespaces

    @property
    def subnet(self) -> int:
        return 1 + int(self.tag) % 250

    @property
    def bridge(self) -> str:
        return f"rlxbr{self.tag}"

    def addr(self, i: int) -> str:
        return f"10.231.{self.subnet}.{i}"

    @property
    def hosts(self) -> dict[str, str]:
        """Host name -> address (what to give mpiexec -hosts)."""
        return {name: self.addr(2 + i) for i, name in enumerate(self.names)}

    @property
    def launcher(self) -> Path:
        return self.dir / "launcher"

    @property
    def local(self) -> Path:
        """A folder each host sees privately (empty from the root namespace)."""
        return self.dir / "local"

    def mpiexec_args(self, ranks: int) -> list[str]:
        return ["-launcher", "ssh", "-launcher-exec", str(self.launcher), "-iface", self.bridge,
                "-hosts", ",".join(self.hosts.values()), "-n", str(ranks)]

    def up(self) -> "TwoHosts":
        self.dir = Path(self.dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.local.mkdir(exist_ok=True)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.addr(1)}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                self._host(name, self.addr(2 + i), i)
            self._write_launcher()
        except BaseException:
            self.down()
            raise
        return self

    def _host(self, name: str, addr: str, i: int) -> None:
        ns, veth = f"rlx{self.tag}{name}", f"rlx{self.tag}v{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        ready = self.dir / f"{name}.ready"
        script = (f"hostname {name} && mount -t tmpfs -o size=512m tmpfs /dev/shm && "
                  f"mount -t tmpfs -o size=256m tmpfs {self.local} && touch {ready} && exec sleep 100000")
        holder = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "--ipc", "--mount",
                                   "--propagation", "private", "sh", "-c", script],
                                  env={**os.environ, "PATH": _SBIN}, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.holders[name] = holder.pid  # ip netns exec and unshare exec: the pid is the sleep's
        (self.dir / f"{addr}.pid").write_text(str(holder.pid))
        (self.dir / f"{name}.ns").write_text(ns)
        deadline = time.monotonic() + 20
        while not ready.exists():
            if holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {name} did not come up: {holder.stderr.read() if holder.stderr else ''}")
            time.sleep(0.05)

    def _write_launcher(self) -> None:
        self.launcher.write_text(f"""#!/bin/sh
# ssh stand-in for hydra: launcher -x HOST WORDS... runs WORDS with sh -c in HOST's namespaces
[ "$1" = "-x" ] && shift
host=$1; shift
pid=$(cat "{self.dir}/$host.pid") || exit 255
exec nsenter -t "$pid" -u -i -n -m -- sh -c "cd \\"$PWD\\" 2>/dev/null; $*"
""")
        self.launcher.chmod(0o755)

    def run_in(self, name: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside host ``name`` (e.g. to write to its private ``local`` folder)."""
        return subprocess.run(["nsenter", "-t", str(self.holders[name]), "-u", "-i", "-n", "-m", "--", *cmd],
                              env={**os.environ, "PATH": _SBIN}, **kw)

    def down(self) -> None:
        for name, pid in list(self.holders.items()):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            self.holders.pop(name)
        for f in self.dir.glob("*.ns"):
            _ip("netns", "del", f.read_text().strip(), check=False)
            f.unlink()
        _ip("link", "del", self.bridge, check=False)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__, file=sys.stderr)
        return 2
    hosts = TwoHosts(Path(argv[1]))
    if argv[0] == "up":
        if (reason := missing_reason()) is not None:
            print(reason, file=sys.stderr)
            return 1
        hosts.up()
        (hosts.dir / "state").write_text(f"{hosts.tag} " + " ".join(f"{k}={v}" for k, v in hosts.holders.items()))
        print("mpiexec " + " ".join(hosts.mpiexec_args(4)) + " python -m rlx_mpi run jobs/tiny.toml")
        return 0
    tag, *pairs = (hosts.dir / "state").read_text().split()
    hosts.dir, hosts.tag = hosts.dir.resolve(), tag
    hosts.holders = {k: int(v) for k, v in (p.split("=") for p in pairs)}
    hosts.down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
