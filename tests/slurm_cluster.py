"""A real single-node Slurm for the tests: munged, slurmctld and slurmd started by hand as root.

    python tests/slurm_cluster.py up DIR     start the daemons with their config in DIR; prints
                                             the `export SLURM_CONF=...` line to use sbatch by hand
    python tests/slurm_cluster.py down DIR   stop them (each by its PID)

It installs nothing (.ci/run installs `slurmctld slurmd slurm-client munge`) and touches nothing
outside DIR except the cgroups slurmd makes for its jobs. Facts it relies on:
- NodeName is `hostname -s` (slurmd checks it), reached at 127.0.0.1;
- 4 tasks on a 2-core machine need CPUs=4 with SlurmdParameters=config_overrides;
- munged's socket folder must be mode 755 and the key 0600, owned by the user munged runs as;
- MPICH names its /dev/shm segment after the Slurm job id and a killed job leaves it behind, so
  job ids start at a random FirstJobId (a rerun never meets an old segment);
- per-job memory limits (`--mem`) need TaskPlugin=task/cgroup with a cgroup.conf; where cgroups
  cannot be made (no cgroup filesystem, not root) task/affinity is used and `cgroups` is False;
- finished jobs stay visible to `scontrol show job` for MinJobAge, and jobcomp/filetxt records
  every job's end state and exit code in DIR/jobcomp.txt (no accounting database needed).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SlurmCluster", "missing_reason"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue")


def missing_reason() -> str | None:
    """Why a Slurm cannot be brought up here, or None when it can."""
    if sys.platform != "linux":
        return "Slurm tests need Linux"
    if os.geteuid() != 0:
        return "Slurm tests need root (munged, slurmd); CI runs them as root"
    lacking = [d for d in DAEMONS + CLIENTS + ("mungekey",) if shutil.which(d, path=_PATH) is None]
    if lacking:
        return f"Slurm is not installed (no {', '.join(lacking)}): apt-get install slurmctld slurmd slurm-client munge"
    return None


_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cgroups_work() -> bool:
    """Can we make a memory cgroup (v1) here? slurmd's task/cgroup needs to."""
    base = Path("/sys/fs/cgroup/memory")
    if not (base / "cgroup.procs").exists():
        return False
    probe = base / f"rlx-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


@dataclass
class SlurmCluster:
    """One node, one partition (`debug`), 4 CPUs, jobs kept visible for an hour."""

    dir: Path
    cpus: int = 4
    memory_mb: int = 8000
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    cgroups: bool = False
    pids: dict = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict:
        """Environment for sbatch/srun/scontrol: this cluster's config, sbin on PATH."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = _PATH
        for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "PMI_", "PMIX_"))]:
            if var != "SLURM_CONF":
                del env[var]
        return env

    # -- bring up ------------------------------------------------------------------------------

    def write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        os.chmod(d / "munge", 0o755)  # munged refuses a socket folder others can write
        self.cgroups = _cgroups_work()
        task = "task/cgroup" if self.cgroups else "task/none"  # task/affinity cannot lay out CPUs=4 on 2 cores
        proctrack = "proctrack/cgroup" if self.cgroups else "proctrack/linuxproc"
        ctl, node = _free_port(), _free_port()
        self.conf.write_text(f"""# written by tests/slurm_cluster.py
ClusterName=rlxtest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctl}
SlurmdPort={node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=pmi2
ProctrackType={proctrack}
TaskPlugin={task}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId={random.randint(100_000, 9_000_000)}
MinJobAge=3600
KillWait=2
InactiveLimit=30
MessageTimeout=20
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        # cgroup v1 (what this kind of machine has); Slurm picks the plugin from the mounts
        (d / "cgroup.conf").write_text("""CgroupPlugin=autodetect
CgroupMountpoint=/sys/fs/cgroup
ConstrainRAMSpace=yes
ConstrainSwapSpace=yes
ConstrainCores=no
AllowedRAMSpace=100
AllowedSwapSpace=0
""")

    def up(self, timeout_s: float = 60.0) -> "SlurmCluster":
        """Start munged, slurmctld and slurmd; wait until the node is idle."""
        self.dir = Path(self.dir).resolve()
        self.write_config()
        d = self.dir
        key = d / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--force"], check=True, env=self.env,
                       capture_output=True, timeout=30)
        os.chmod(key, 0o600)
        self._start("munged", ["munged", f"--socket={d}/munge/munge.socket", f"--key-file={key}",
                               f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/log/munged.log",
                               f"--seed-file={d}/munge/munged.seed", "--force"], d / "munge" / "munged.pid")
        self._start("slurmctld", ["slurmctld", "-f", str(self.conf)], d / "slurmctld.pid")
        self._start("slurmd", ["slurmd", "-f", str(self.conf)], d / "slurmd.pid")
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.scontrol("show", "node", self.host, check=False)
            if re.search(r"State=IDLE\b", state):
                return self
            time.sleep(0.5)
        self.down()
        raise RuntimeError(f"Slurm node not idle within {timeout_s} s:\n{state}\n{self.logs()}")

    def _start(self, name: str, cmd: list[str], pid_file: Path, timeout_s: float = 20.0) -> None:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            self.down()
            raise RuntimeError(f"{name} failed to start (exit {out.returncode}): {out.stderr}\n{self.logs()}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.pids[name] = int(pid_file.read_text().split()[0])
                return
            except (OSError, ValueError, IndexError):
                time.sleep(0.1)
        self.down()
        raise RuntimeError(f"{name} wrote no pid file {pid_file}\n{self.logs()}")

    def down(self) -> None:
        """Stop each daemon by its PID (slurmd first), waiting for it to go."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)

    def logs(self) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*.log")):
            out.append(f"--- {f.name} (last lines)\n" + "\n".join(f.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(out)

    # -- use -----------------------------------------------------------------------------------

    def scontrol(self, *args: str, check: bool = True) -> str:
        p = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=30)
        if check and p.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {p.stderr}")
        return p.stdout + p.stderr

    def sbatch(self, *args: str, cwd=None, env: dict | None = None) -> str:
        """Submit; return the job id."""
        p = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                           capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {p.stderr}")
        return p.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        text = self.scontrol("show", "job", "-o", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout_s: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                            "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                                                            "DEADLINE")) -> dict[str, str]:
        """Poll until the job reaches one of ``states``; raises TimeoutError (after scancel)."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.3)
        self.cancel(job_id)
        raise TimeoutError(f"job {job_id} not ended within {timeout_s} s: {info}")

    def cancel(self, job_id: str) -> None:
        subprocess.run(["scancel", job_id], env=self.env, capture_output=True, timeout=30)

    def srun(self, *args: str, timeout_s: float = 120, cwd=None, env: dict | None = None) -> subprocess.CompletedProcess:
        """A job of its own run in the foreground (srun outside an allocation)."""
        t0 = time.monotonic()
        name = f"rlx-test-{os.getpid()}-{time.monotonic_ns()}"  # to scancel the job if srun must be killed
        p = subprocess.Popen(["srun", f"--job-name={name}", *args], env={**self.env, **(env or {})}, cwd=cwd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", f"--name={name}"], env=self.env, capture_output=True, timeout=30)
            try:
                out, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate()
            raise TimeoutError(f"srun {' '.join(args)} did not end within {timeout_s} s\n{out}\n{err}") from None
        result = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        result.elapsed = time.monotonic() - t0
        return result


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__, file=sys.stderr)
        return 2
    cluster = SlurmCluster(Path(argv[1]))
    if argv[0] == "up":
        if (reason := missing_reason()) is not None:
            print(reason, file=sys.stderr)
            return 1
        cluster.up()
        (cluster.dir / "pids").write_text(" ".join(f"{k}={v}" for k, v in cluster.pids.items()))
        print(f"export SLURM_CONF={cluster.conf}  # cgroups: {cluster.cgroups}")
        return 0
    cluster.pids = dict(kv.split("=") for kv in (cluster.dir / "pids").read_text().split())
    cluster.pids = {k: int(v) for k, v in cluster.pids.items()}
    cluster.dir = cluster.dir.resolve()
    cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
