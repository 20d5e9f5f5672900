"""The bubblewrap sandbox of one kernel: what it can see and what it can do (docs/internals.md, "The sandbox").

A kernel starts as `sh -c '<oom_score_adj 1000, join its cgroups> exec bwrap --args 3 ...' -- prlimit <limits> --
[setpriv <uid>] -- python -m l0_toolbox.boot -f /run/l0/conn.json`; bwrap reads its options, the seccomp filter and
the generated files from fds, so nothing inside names a folder of the project. It sees /usr, /bin, /lib*, a few /etc
files, the interpreter and its venv and the toolbox zip read-only; its own size-limited tmpfs at /workspace, /tmp,
/dev/shm and /run/l0 (its ipc sockets, conn.json, tools.sock); its own /proc and a minimal /dev. Every namespace (no
user namespace on a root host, where each sandbox runs as its own unprivileged uid, `UidLease`, with no capability);
network off unless `network=True`; prlimit per process, cgroup memory and tasks per sandbox; seccomp refuses new
namespaces, mounts, bpf, keyrings, io_uring, ptrace (and without a cgroup memfds and SysV shm). `protections` says
which of these the host provides.
"""

from __future__ import annotations

import fcntl
import functools
import io
import logging
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from l0_min.config import SandboxConfig, is_number
from l0_min.sandbox import cgroup

log = logging.getLogger(__name__)

# the file system as the kernel sees it
WORKSPACE = "/workspace"
RUN_DIR = "/run/l0"
CONN_FILE = f"{RUN_DIR}/conn.json"
IPC_BASE = f"{RUN_DIR}/ipc"  # zmq ipc sockets are IPC_BASE-1 ... IPC_BASE-5
TOOLS_SOCKET = f"{RUN_DIR}/tools.sock"
TMPFS = ("/dev/shm", "/tmp", WORKSPACE, RUN_DIR)  # its writable mounts, each a size-limited tmpfs
TOOLBOX_PARENT = "/opt/l0"  # on PYTHONPATH; holds l0_toolbox
VENV = "/opt/venv"
TOOLBOX_SRC = Path(__file__).resolve().parent / "toolbox"

ETC = ["ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives", "ssl", "ca-certificates",
       "os-release", "mime.types"]  # fmt: skip
ETC_NET = ["resolv.conf", "hosts", "nsswitch.conf", "gai.conf", "host.conf", "services", "protocols"]
SYSTEM_DIRS = ["bin", "sbin", "lib", "lib32", "lib64", "libx32"]  # symlinks into /usr on merged-usr systems

INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap; "
                "conda: conda install -c conda-forge bubblewrap), or run kernels without a sandbox, which is "
                "unsafe, with sandbox.enabled=false")


class SandboxError(RuntimeError):
    """The sandbox cannot be set up; the message says what is missing and how to fix it."""


def check(cfg: SandboxConfig) -> None:
    """Reject bad sandbox settings with an error that names the field."""
    for name in ("memory_mb", "total_memory_mb", "max_procs", "file_size_mb", "open_files", "cpu_seconds",
                 "workspace_mb", "tmp_mb", "uid_base", "uid_slots"):  # fmt: skip
        v = getattr(cfg, name)
        if not is_number(v, integer=True) or v <= 0:
            raise ValueError(f"sandbox.{name} must be a positive integer, got {v!r}")
    for name in cfg.env_whitelist:
        if not name.isidentifier():
            raise ValueError(f"sandbox.env_whitelist: {name!r} is not an environment variable name")
    for spec in cfg.ro_binds:
        src, sep, dest = spec.partition(":")
        if not sep or not os.path.isabs(src) or not os.path.isabs(dest):
            raise ValueError(f"sandbox.ro_binds: {spec!r} is not of the form /host/path:/sandbox/path")
        if not os.path.exists(src):
            raise ValueError(f"sandbox.ro_binds: {src} does not exist on the host")


def find_tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        hint = INSTALL_HINT if name == "bwrap" else f"install util-linux, which provides {name}"
        raise SandboxError(f"'{name}' was not found on PATH: {hint}")
    return path


def runs_as_root() -> bool:
    return os.geteuid() == 0


def launch(cfg: SandboxConfig, runtime_dir: str, *, conn_file: str, kernel_args: list[str], tools_socket: str | None,
           extra_env: dict[str, str], **kw) -> tuple[list[str], dict[str, str], str, str | None]:  # fmt: skip
    """How to start one kernel (sandboxed unless cfg.enabled is False): its kernelspec argv, the
    environment of the launched process (bwrap clears it for the kernel), the base path of its ipc
    sockets as the kernel sees it, and its working directory (None: bwrap's --chdir).

    `runtime_dir` is the kernel's private host folder (0700): it holds `conn_file` and the files
    the launcher hands to bwrap; `kw` goes to `command`: uid (the leased uid on a root host) and
    cgroup_procs (the cgroup.procs files the launcher joins).
    """
    boot = ["-m", "l0_toolbox.boot", "-f"]
    if cfg.enabled:
        argv = command(cfg, runtime_dir, [python_in_sandbox(), *boot, CONN_FILE, *kernel_args], conn_file=conn_file,
                       tools_socket=tools_socket, extra_env=extra_env, **kw)  # fmt: skip
        return argv, {"PATH": "/usr/bin:/bin"}, IPC_BASE, None
    _warn_unsandboxed()
    work, tmp, pylib = (os.path.join(runtime_dir, d) for d in ("workspace", "tmp", "pylib"))
    for d in (work, tmp, pylib):
        os.makedirs(d, exist_ok=True)
    os.symlink(TOOLBOX_SRC, os.path.join(pylib, "l0_toolbox"))
    env = _env(cfg, home=work, tmp=tmp, pythonpath=pylib, path=os.path.dirname(sys.executable) + ":/usr/bin:/bin")
    env.update(extra_env, L0_TOOLS_SOCKET=tools_socket or "")
    argv = [sys.executable, *boot, conn_file, *kernel_args]
    return argv, env, os.path.join(runtime_dir, "ipc"), work


@functools.cache
def _warn_unsandboxed() -> None:
    log.warning("\n" + "!" * 78 + "\n!! sandbox.enabled=false: kernels run WITHOUT bubblewrap and WITHOUT limits.\n"
                "!! Agent code can read and write everything this user can, and use the network.\n" + "!" * 78)


def command(cfg: SandboxConfig, runtime_dir: str, inner: list[str], *, conn_file: str | None = None,
            tools_socket: str | None = None, extra_env: dict[str, str] | None = None, uid: int | None = None,
            cgroup_procs: list[str] = ()) -> list[str]:  # fmt: skip
    """The command that runs `inner` (an argv as seen inside) in the sandbox. bwrap's options go to
    `runtime_dir`/bwrap.args, which the launcher shell opens as fd 3 (see the module docstring)."""
    bwrap = find_tool("bwrap")
    files = [os.path.join(runtime_dir, "bwrap.args")]  # opened by the launcher as fds 3, 4, ...

    def fd(path: str) -> str:
        files.append(path)
        return str(2 + len(files))

    me = os.getuid() if uid is None else uid
    passwd = f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nagent:x:{me}:{me}:agent:{WORKSPACE}:/bin/sh\n"
    data = {f"{TOOLBOX_PARENT}/l0_toolbox.zip": toolbox_zip(), "/etc/passwd": passwd,
            "/etc/group": f"root:x:0:\nagent:x:{me}:\n"}
    bpf = seccomp_filter(charged=bool(cgroup_procs) or not cfg.enabled)
    args = _namespaces(cfg, uid) + (["--seccomp", fd(_write(runtime_dir, "seccomp.bpf", bpf))] if bpf else [])
    args += _mounts(cfg, tools_socket)
    for dest, content in data.items():
        args += ["--perms", "0444", "--ro-bind-data", fd(_write(runtime_dir, os.path.basename(dest), content)), dest]
    if conn_file:
        args += ["--perms", "0444", "--ro-bind-data", fd(conn_file), CONN_FILE]
    args += ["--remount-ro", "/dev", "--remount-ro", "/"]  # only the tmpfs mounts stay writable
    path = f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin"
    env = _env(cfg, home=WORKSPACE, tmp="/tmp", pythonpath=f"{TOOLBOX_PARENT}/l0_toolbox.zip", path=path)
    env.update(extra_env or {}, L0_TOOLS_SOCKET=TOOLS_SOCKET if tools_socket else "")
    args += ["--chdir", WORKSPACE, "--hostname", "sandbox", "--clearenv"]
    for k, v in env.items():
        args += ["--setenv", k, v]
    run = ["--", find_tool("prlimit"), f"--as={cfg.memory_mb << 20}", f"--nproc={cfg.max_procs}",  # per process
           f"--fsize={cfg.file_size_mb << 20}", f"--nofile={cfg.open_files}", f"--cpu={cfg.cpu_seconds}", "--core=0",
           "--"]  # fmt: skip
    if uid is not None:
        run += [find_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--"]  # fmt: skip
    _write(runtime_dir, "bwrap.args", "".join(a + "\0" for a in args))
    join = "echo 1000 >/proc/self/oom_score_adj && " + "".join(f"echo 0 >{shlex.quote(p)} && " for p in cgroup_procs)
    redirects = " ".join(f"{3 + i}<{shlex.quote(p)}" for i, p in enumerate(files))
    return ["/bin/sh", "-c", f'{join}exec "$0" --args 3 "$@" {redirects}', bwrap, *run, *inner]


def _write(folder: str, name: str, content: str | bytes) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())
    return path


def _namespaces(cfg: SandboxConfig, uid: int | None) -> list[str]:
    common = ["--die-with-parent", "--new-session"]
    if uid is None:  # user namespace mode: --unshare-all, optionally keeping the network
        no_nested = ["--unshare-user", "--disable-userns"] if bwrap_version() >= (0, 8) else []
        return ["--unshare-all", *no_nested, *(["--share-net"] if cfg.network else []), *common]
    # privileged mode on a root host: all namespaces but the user one; setpriv needs these caps (then drops all)
    caps = [a for cap in ("SETUID", "SETGID", "SETPCAP") for a in ("--cap-add", f"CAP_{cap}")]
    net = [] if cfg.network else ["--unshare-net"]
    return ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try", *net, *common, *caps]


def _dir(path: str) -> list[str]:
    # bwrap's privileged mode makes missing folders 0700: make them 0755 so the sandbox uid can pass
    return ["--perms", "0755", "--dir", path]


def _ro(src: str, dest: str) -> list[str]:
    """A read-only bind at `dest`, its parent folders made first (0755)."""
    p = Path(dest).parent
    return [a for d in reversed([p, *p.parents]) if str(d) != "/" for a in _dir(str(d))] + ["--ro-bind", src, dest]


def _tmpfs(dest: str, size_mb: float, mode: str) -> list[str]:
    return ["--perms", mode, "--size", str(int(size_mb * (1 << 20))), "--tmpfs", dest]


def _mounts(cfg: SandboxConfig, tools_socket: str | None) -> list[str]:
    a = ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_DIRS:
        p = f"/{name}"
        if os.path.islink(p):
            a += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            a += ["--ro-bind", p, p]
    a += _dir("/etc")
    for name in ETC + (ETC_NET if cfg.network else []):
        if os.path.exists(f"/etc/{name}"):
            a += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    a += _python_mounts() + _dir(TOOLBOX_PARENT)
    for spec in cfg.ro_binds:
        src, _, dest = spec.partition(":")
        a += _ro(src, dest)
    a += ["--proc", "/proc", "--dev", "/dev"]
    a += _tmpfs("/dev/shm", cfg.tmp_mb, "1777") + _tmpfs("/tmp", cfg.tmp_mb, "1777")
    a += _tmpfs(WORKSPACE, cfg.workspace_mb, "0777")
    a += _dir("/run") + _tmpfs(RUN_DIR, 1, "0777")
    if tools_socket:
        a += ["--ro-bind", tools_socket, TOOLS_SOCKET]
    return a


@functools.cache
def toolbox_zip() -> bytes:
    """The toolbox as one zip (Python imports from it), bound into the sandbox as data."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in sorted(TOOLBOX_SRC.glob("*.py")):
            z.write(f, f"l0_toolbox/{f.name}")
    return buf.getvalue()


# seccomp: a deny-list on top of the namespaces, as a classic BPF program (no libseccomp needed).
# Numbers per architecture: x86_64 (asm/unistd_64.h), aarch64 (asm-generic/unistd.h).
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
DENIED = {  # name: (x86_64, aarch64); EPERM
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "unshare": (272, 97), "setns": (308, 268),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442), "bpf": (321, 280),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
}  # fmt: skip
UNCHARGED = {"memfd_create": (319, 279), "memfd_secret": (447, 447), "shmget": (29, 194)}  # without a cgroup
CLONE = {"clone": (56, 220), "clone3": (435, 435)}
CLONE_NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


def seccomp_filter(machine: str | None = None, charged: bool = True) -> bytes | None:
    """The seccomp program bwrap loads (--seccomp FD), or None on an architecture without a table.

    EPERM for the DENIED syscalls, for clone() with a namespace flag and for foreign-ABI calls (i386, x32), and, where
    no cgroup charges the sandbox's memory (not `charged`), for the UNCHARGED ones, whose memory no process's PSS
    shows (cgroup.watch); ENOSYS for clone3, whose flags a filter cannot read, so that glibc falls back to clone().
    Everything else is allowed: threads, fork, exec, signals within the sandbox.
    """
    arch = machine or platform.machine()
    if arch not in AUDIT_ARCH:
        return None
    col = list(AUDIT_ARCH).index(arch)
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    prog = [  # (code, jump if true, jump if false, k); a label jumps to that instruction
        (ld, 0, 0, 4),  # A = seccomp_data.arch
        (jeq, 0, "deny", AUDIT_ARCH[arch]),  # another ABI (i386): deny
        (ld, 0, 0, 0),  # A = seccomp_data.nr
        (jge, "deny", 0, 0x40000000),  # x32 numbers: deny
        (jeq, "enosys", 0, CLONE["clone3"][col]),
        (jeq, 0, "table", CLONE["clone"][col]),
        (ld, 0, 0, 16),  # clone: A = the low half of args[0], its flags
        (jset, "deny", "allow", CLONE_NEW_NAMESPACES),
    ]
    labels = {"table": len(prog)}
    prog += [(jeq, "deny", 0, nums[col]) for nums in (DENIED | ({} if charged else UNCHARGED)).values()]
    for name, k in [("allow", 0x7FFF0000), ("deny", 0x00050000 | 1), ("enosys", 0x00050000 | 38)]:
        labels[name] = len(prog)
        prog.append((ret, 0, 0, k))

    def jump(i: int, to) -> int:
        return labels[to] - i - 1 if isinstance(to, str) else to

    return b"".join(struct.pack("=HBBI", code, jump(i, jt), jump(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog))


@functools.cache
def bwrap_version() -> tuple[int, ...]:
    out = subprocess.run([find_tool("bwrap"), "--version"], capture_output=True, text=True).stdout
    return tuple(int(x) for x in out.split()[-1].split(".") if x.isdigit()) if out.strip() else (0,)


def protections(cfg: SandboxConfig) -> tuple[list[str], dict[str, str]]:
    """What guards this host's sandboxes, and what it cannot provide ({protection: why})."""
    who = "an own uid per sandbox, no capabilities" if runs_as_root() else "user namespace" + (
        ", --disable-userns" if bwrap_version() >= (0, 8) else "")
    on, missing = [f"bwrap {'.'.join(map(str, bwrap_version()))}", who], {}
    if seccomp_filter() is not None:
        on.append(f"seccomp ({platform.machine()}: no new namespaces, mounts, bpf, io_uring, ptrace)")
    else:
        missing["seccomp"] = f"no seccomp table for the {platform.machine()!r} architecture (x86_64, aarch64 only)"
    on.append("oom_score_adj 1000 (the OOM killer takes a sandbox before the host)")
    how = cgroup.detect()
    how = how if isinstance(how, str) else cgroup.shared()
    share = f"{int(cgroup.available_mb() * cgroup.SHARE):,} MB, {cgroup.SHARE:.0%} of the {cgroup.available_mb():,} MB"
    if isinstance(how, str):
        missing["cgroup"] = how
        on.append(f"memory watch: each sandbox's PSS and tmpfs ({cfg.total_memory_mb:,} MB); memfds, SysV shm refused")
    else:
        on.append(f"cgroup v{how[0]} memory ({cfg.total_memory_mb:,} MB) + pids ({cfg.max_procs + 2})")
    on.append(f"all sandboxes together {share} available at start-up (past {cgroup.HIGH:.0%} the host kills one "
              "holding half, else the one growing the most)")
    return on, missing


def _python_mounts() -> list[str]:
    """The host's interpreter (at its own path: compiled-in paths keep working) and its venv."""
    a: list[str] = []
    base = sys.base_prefix
    for p in dict.fromkeys([base, os.path.realpath(base)]):
        if not (p + "/").startswith("/usr/"):
            a += _ro(p, p)
    if sys.prefix != sys.base_prefix:  # a virtual environment, mounted at /opt/venv
        a += _ro(sys.prefix, VENV)
    return a


def python_in_sandbox() -> str:
    if sys.prefix != sys.base_prefix:
        rel = os.path.relpath(sys.executable, sys.prefix)
        if not rel.startswith(".."):
            return f"{VENV}/{rel}"
    return os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def _env(cfg: SandboxConfig, *, home: str, tmp: str, pythonpath: str, path: str) -> dict[str, str]:
    whitelisted = {k: os.environ[k] for k in cfg.env_whitelist if k in os.environ}
    # hundreds of kernels share the CPUs: one thread per math library, few malloc arenas
    return {"LANG": "C.UTF-8", **whitelisted} | dict(
        PATH=path, HOME=home, USER="agent", LOGNAME="agent", TMPDIR=tmp, PYTHONPATH=pythonpath,
        PYTHONDONTWRITEBYTECODE="1", IPYTHONDIR=f"{tmp}/.ipython", MPLCONFIGDIR=f"{tmp}/.matplotlib", MPLBACKEND="Agg",
        OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="2")


class UidLease:
    """One unused host uid for one sandbox on a root host, held by a lock file while it lives.

    flock locks are per open file, so one lock serves threads, coroutines and other processes
    alike, and a crashed process releases its uids.
    """

    _next = 0  # where the next search starts, so that a fresh lease rarely probes held slots

    def __init__(self, cfg: SandboxConfig):
        folder = Path(tempfile.gettempdir()) / "l0_min-uids"
        folder.mkdir(mode=0o700, exist_ok=True)
        for i in range(cfg.uid_slots):
            slot = (UidLease._next + i) % cfg.uid_slots
            fd = os.open(folder / f"{cfg.uid_base + slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            UidLease._next = slot + 1
            self.uid, self._fd = cfg.uid_base + slot, fd
            return
        raise SandboxError(f"all {cfg.uid_slots} sandbox uids from sandbox.uid_base={cfg.uid_base} are in use")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
