"""The bubblewrap command line and what a process inside it can see and do.

Most tests run a short Python probe in the real sandbox (the same mounts, namespaces, limits and
uid switch a kernel gets), which takes ~50 ms instead of a kernel start.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from l0_min.sandbox import bwrap as sb
from l0_min.config import ConfigError, SandboxConfig, resolve

PROJECT = Path(__file__).resolve().parents[1]


def run_probe(cfg: SandboxConfig, code: str, tmp_path: Path, timeout: float = 30) -> dict:
    """Run `code` (which sets a dict `out`) in the sandbox; return `out` as the host sees it."""
    lease = sb.UidLease(cfg) if sb.runs_as_root() else None
    try:
        probe = f"import json, os, sys\nout = {{}}\n{code}\nprint('OUT=' + json.dumps(out))"
        argv = sb.command(cfg, str(tmp_path), [sb.python_in_sandbox(), "-c", probe], uid=lease.uid if lease else None)
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={"PATH": "/usr/bin:/bin"})
    finally:
        if lease:
            lease.release()
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("OUT=")]
    assert lines, f"probe failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return json.loads(lines[-1][4:])


# --------------------------------------------------------------------------- the command line


def full_argv(cfg: SandboxConfig, tmp_path: Path, inner=("true",), **kw) -> list[str]:
    """The launcher's command line followed by bwrap's options, which it reads from a file (--args 3)."""
    argv = sb.command(cfg, str(tmp_path), list(inner), **kw)
    return argv + [a.decode() for a in (tmp_path / "bwrap.args").read_bytes().split(b"\0")[:-1]]


def test_command_line_has_the_isolation_flags(tmp_path):
    launcher = sb.command(SandboxConfig(), str(tmp_path), ["true"], uid=1_999_999_999, cgroup_procs=["/cg/cgroup.procs"])
    assert launcher[:2] == ["/bin/sh", "-c"] and launcher[3] == shutil.which("bwrap")
    assert launcher[2].startswith("echo 1000 >/proc/self/oom_score_adj && echo 0 >/cg/cgroup.procs && exec \"$0\" --args 3 \"$@\" 3<")  # OOM first, cgroup, bwrap
    setpriv = launcher[launcher.index(shutil.which("setpriv")) :]
    assert {"--reuid=1999999999", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"} <= set(setpriv)
    argv = full_argv(SandboxConfig(), tmp_path)
    for flag in ("--die-with-parent", "--new-session", "--clearenv", "--unshare-pid", "--unshare-ipc", "--unshare-uts"):
        assert flag in argv or ("--unshare-all" in argv and flag.startswith("--unshare")), flag
    assert "--share-net" not in argv
    assert "--unshare-net" in argv or "--unshare-all" in argv
    assert argv[argv.index("--chdir") + 1] == sb.WORKSPACE
    pairs = set(zip(argv, argv[1:]))
    assert ("--remount-ro", "/") in pairs and ("--remount-ro", "/dev") in pairs
    # prlimit carries every configured limit
    assert ("--seccomp", "4") in pairs  # fd 4: the filter; the host paths of generated files are not arguments
    assert ("--ro-bind-data", "5") in pairs and not any(str(tmp_path) in a for a in argv[5:])
    cfg = SandboxConfig(memory_mb=1000, max_procs=33, file_size_mb=7, open_files=99, cpu_seconds=42)
    argv = sb.command(cfg, str(tmp_path), ["true"])
    want = {f"--as={1000 << 20}", "--nproc=33", f"--fsize={7 << 20}", "--nofile=99", "--cpu=42", "--core=0"}
    assert want <= set(argv)
    assert argv[-1] == "true"


def test_seccomp_filter_shape():
    for arch in ("x86_64", "aarch64"):
        prog = sb.seccomp_filter(arch)
        assert len(prog) % 8 == 0 and 30 < len(prog) // 8 < 256  # sock_filter entries; 8-bit jumps reach
    assert sb.seccomp_filter("riscv64") is None  # and protections() names it missing


def test_network_flag_shares_the_network(tmp_path):
    argv = full_argv(SandboxConfig(network=True), tmp_path)
    assert "--unshare-net" not in argv
    assert "--share-net" in argv or "--unshare-all" not in argv
    assert "/etc/resolv.conf" in argv or not os.path.exists("/etc/resolv.conf")


def test_environment_is_a_whitelist(tmp_path, monkeypatch):
    monkeypatch.setenv("L0_TEST_SECRET", "hunter2")
    monkeypatch.setenv("L0_TEST_ALLOWED", "yes")
    argv = full_argv(SandboxConfig(env_whitelist=["L0_TEST_ALLOWED"]), tmp_path)
    setenv = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--setenv"}
    assert setenv["L0_TEST_ALLOWED"] == "yes"
    assert "L0_TEST_SECRET" not in setenv and "hunter2" not in argv
    assert setenv["HOME"] == sb.WORKSPACE


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"sandbox\.memory_mb must be a positive integer, got 0"):
        sb.check(SandboxConfig(memory_mb=0))
    with pytest.raises(ValueError, match=r"sandbox\.ro_binds: 'data' is not of the form"):
        sb.check(SandboxConfig(ro_binds=["data"]))
    with pytest.raises(ValueError, match=r"sandbox\.ro_binds: /nonexistent-l0 does not exist"):
        sb.check(SandboxConfig(ro_binds=["/nonexistent-l0:/data"]))
    with pytest.raises(ValueError, match=r"sandbox\.env_whitelist: 'A B'"):
        sb.check(SandboxConfig(env_whitelist=["A B"]))
    with pytest.raises(ConfigError, match="sandbox.uid_base"):
        resolve(["sandbox.uid_base=abc"])


def test_missing_bwrap_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(sb.shutil, "which", lambda *a, **k: None)
    with pytest.raises(sb.SandboxError) as e:
        sb.find_tool("bwrap")
    msg = str(e.value)
    assert "'bwrap' was not found" in msg and "apt-get install bubblewrap" in msg and "sandbox.enabled=false" in msg


def test_uid_leases_are_distinct_and_reusable():
    cfg = SandboxConfig(uid_base=1_999_000_000, uid_slots=3)
    leases = [sb.UidLease(cfg) for _ in range(3)]
    assert len({lease.uid for lease in leases}) == 3
    assert all(cfg.uid_base <= lease.uid < cfg.uid_base + 3 for lease in leases)
    with pytest.raises(sb.SandboxError, match="all 3 sandbox uids"):
        sb.UidLease(cfg)
    freed = leases[1].uid
    leases[1].release()
    again = sb.UidLease(cfg)
    assert again.uid == freed
    for lease in leases + [again]:
        lease.release()


# --------------------------------------------------------------------------- inside the sandbox

VIEW = """
def listing(p):
    try:
        return sorted(os.listdir(p))
    except OSError as e:
        return type(e).__name__
out['root'] = listing('/')
out['slash_root'] = listing('/root')
out['home'] = listing(os.path.expanduser('~'))
out['cwd'] = os.getcwd()
out['uid'] = os.getuid()
out['pids'] = [p for p in os.listdir('/proc') if p.isdigit()]
out['env'] = dict(os.environ)
out['exists'] = {p: os.path.exists(p) for p in sys.argv[1:] or PATHS}
import resource
names = ['RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_CPU', 'RLIMIT_CORE']
out['limits'] = {n: resource.getrlimit(getattr(resource, n))[0] for n in names}
"""


def test_the_sandbox_sees_only_what_it_needs(tmp_path):
    secret_dir = Path(os.path.expanduser("~"))
    paths = ["/etc/shadow", "/etc/sudoers", str(PROJECT), str(PROJECT / "l0_min" / "sandbox" / "kernel.py"),
             str(secret_dir / ".bashrc"), "/var/log", "/home", str(tmp_path), sys.prefix + "/pyvenv.cfg"]  # fmt: skip
    cfg = SandboxConfig(memory_mb=1500, max_procs=40, file_size_mb=5, open_files=128, cpu_seconds=77)
    out = run_probe(cfg, f"PATHS = {paths!r}\n" + VIEW, tmp_path)
    assert not any(out["exists"].values()), out["exists"]
    assert out["cwd"] == "/workspace" and out["home"] == []
    assert out["uid"] != 0
    # the root holds the system, the interpreter and the sandbox's own mounts, nothing else
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "run", "sbin", "tmp", "usr",
               "workspace", *Path(sys.base_prefix).parts[1:2]}  # fmt: skip
    assert set(out["root"]) <= allowed, set(out["root"]) - allowed
    if sys.base_prefix.startswith("/root/"):  # the interpreter lives in root's home: only its path shows
        assert out["slash_root"] == [Path(sys.base_prefix).parts[2]]
    else:
        assert out["slash_root"] in ("FileNotFoundError", [])
    # its own pid namespace: bwrap's init and the probe
    assert len(out["pids"]) <= 2
    # the environment is the whitelist plus the sandbox's own variables
    own = {"PATH", "PWD", "HOME", "USER", "LOGNAME", "TMPDIR", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "IPYTHONDIR",
           "MPLCONFIGDIR", "MPLBACKEND", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
           "MALLOC_ARENA_MAX", "L0_TOOLS_SOCKET"}  # fmt: skip
    assert set(out["env"]) <= own | {"LANG", "LC_ALL", "TZ"}
    assert out["limits"] == {"RLIMIT_AS": 1500 << 20, "RLIMIT_NPROC": 40, "RLIMIT_FSIZE": 5 << 20,
                             "RLIMIT_NOFILE": 128, "RLIMIT_CPU": 77, "RLIMIT_CORE": 0}  # fmt: skip


WRITES = """
import errno
def try_write(path, n=1):
    try:
        with open(path, 'wb') as f:
            f.write(b'0' * n)
        return 'ok'
    except OSError as e:
        return errno.errorcode[e.errno]
for p in ['/x', '/etc/x', '/usr/x', '/opt/venv/x', '/opt/l0/l0_toolbox.zip', '/dev/x', '/proc/x', '/run/x',
          '/workspace/x', '/tmp/x', '/dev/shm/x']:
    out[p] = try_write(p)
out['big_file'] = try_write('/workspace/big', 3 << 20)
n = 0
while n < 100 and try_write(f'/workspace/fill{n}', 1 << 20) == 'ok':
    n += 1
out['fill_stopped_at_mb'] = n
out['fill_error'] = try_write('/workspace/one_more', 1 << 20)
"""


def test_only_the_tmpfs_mounts_are_writable_and_they_are_limited(tmp_path):
    cfg = SandboxConfig(file_size_mb=2, workspace_mb=8)
    out = run_probe(cfg, WRITES, tmp_path)
    for p in ["/x", "/etc/x", "/usr/x", "/opt/venv/x", "/opt/l0/l0_toolbox.zip", "/dev/x", "/proc/x", "/run/x"]:
        assert out[p] in ("EROFS", "EACCES", "ENOENT"), (p, out[p])
    assert out["/workspace/x"] == out["/tmp/x"] == out["/dev/shm/x"] == "ok"
    assert out["big_file"] == "EFBIG"  # RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write fails)
    assert 5 <= out["fill_stopped_at_mb"] <= 8 and out["fill_error"] == "ENOSPC"  # the 8 MiB workspace is full


NET = """
import socket
try:
    socket.create_connection(('1.1.1.1', 53), timeout=3)
    out['tcp'] = 'connected'
except OSError as e:
    out['tcp'] = type(e).__name__ + ': ' + str(e)
try:
    socket.getaddrinfo('pypi.org', 443)
    out['dns'] = 'resolved'
except OSError as e:
    out['dns'] = type(e).__name__
out['interfaces'] = [name for _, name in socket.if_nameindex()]
"""


def test_the_network_is_off(tmp_path):
    out = run_probe(SandboxConfig(), NET, tmp_path)
    assert "unreachable" in out["tcp"].lower(), out["tcp"]
    assert out["dns"] == "gaierror"
    assert out["interfaces"] == ["lo"]


def test_extra_read_only_binds(tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "doc.txt").write_text("hello")
    code = """
out['read'] = open('/data/corpus/doc.txt').read()
try:
    open('/data/corpus/new', 'w')
    out['write'] = 'ok'
except OSError as e:
    out['write'] = e.errno
"""
    out = run_probe(SandboxConfig(ro_binds=[f"{data}:/data/corpus"]), code, tmp_path)
    assert out["read"] == "hello" and out["write"] == 30  # EROFS


FORKS = r"""
import errno, json, os, time
def write(path):
    try:
        open(path, 'w').close()
        return 'ok'
    except OSError as e:
        return errno.errorcode[e.errno]
writes = {p: write(p) for p in ['/x', '/etc/x', '/dev/x', '/run/x', '/workspace/x', '/tmp/x', '/dev/shm/x']}
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError as e:
    print(json.dumps({"forks": n, "error": errno.errorcode[e.errno], "writes": writes}))
"""


def test_user_namespace_mode_limits_processes_per_sandbox(monkeypatch):
    """The mode of non-root hosts: bwrap makes a user namespace, and RLIMIT_NPROC counts the
    processes of that namespace only, so sandboxes of one host user do not share the limit.

    On a root host the test drops to 'nobody' first. The host's interpreter may not be readable
    by nobody (here it lives in /root), so the probe runs the system python3 without it."""
    folder = tempfile.mkdtemp()  # runtime folder and a stand-in toolbox, readable by nobody
    os.chmod(folder, 0o755)
    try:
        prefix, python = [], sb.python_in_sandbox()
        if sb.runs_as_root():
            prefix = [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"]
            python = shutil.which("python3", path="/usr/bin:/bin")
            assert python, "this test needs a system python3 in /usr/bin on a root host"
            monkeypatch.setattr(sb, "_python_mounts", lambda: [])
            monkeypatch.setattr(sb, "TOOLBOX_SRC", Path(folder))
        argv = prefix + sb.command(SandboxConfig(max_procs=20), folder, [python, "-c", FORKS])
        opts = Path(folder, "bwrap.args").read_text().split("\0")
        assert "--unshare-all" in opts and "--disable-userns" in opts and "--cap-add" not in opts
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results = [json.loads(out.strip().splitlines()[-1]) for out, err in outs]
    for r in results:  # each sandbox reaches the limit on its own: 20 = bwrap's init + probe + 18
        assert r["error"] == "EAGAIN" and r["forks"] == 18, (r, outs)
    # here the sandbox user owns the sandbox's own folders: read-only mounts, not permissions, protect them
    ro = {p: "EROFS" for p in ["/x", "/etc/x", "/dev/x", "/run/x"]}
    assert results[0]["writes"] == {**ro, "/workspace/x": "ok", "/tmp/x": "ok", "/dev/shm/x": "ok"}


def test_a_removed_cgroup_reads_as_empty_and_not_killed():
    """The memory watcher reads each sandbox's cgroup off the event loop; the sandbox may be gone by then (its
    cgroup removed between the watcher's snapshot and its read). Before: IndexError ended the watcher's task."""
    import asyncio

    from l0_min.sandbox import cgroup

    if isinstance(how := cgroup.shared(), str):
        pytest.skip(f"no cgroup on this machine: {how}")
    c = cgroup.Cgroup(f"l0_min-{os.getpid()}-ktest", 64, 16)
    assert c.held() >= 0 and c.oom() == ""
    asyncio.run(c.remove())
    assert c.dirs == [] and c.held() == 0 and c.oom() == ""


@pytest.mark.parametrize("host_stalls", [False, True])
def test_a_read_that_costs_cpu_kills_its_sandbox_unless_the_host_was_reclaiming_memory_in_it(monkeypatch, host_stalls):
    """A read costing over SLOW s of CPU is the sandbox's doing (millions of mappings: tests/test_adversarial.py 20),
    except when the host stalled on memory meanwhile: on a host out of memory every read pays for the kernel's
    reclaim (seen: four innocent kernels killed at 0.3-1.3 s while an SFT run filled the host's 24 GiB)."""
    import asyncio
    import time

    from l0_min.sandbox import cgroup

    clock = iter(range(0, 1000, 2))  # each look at PSI: 2 s more of the host's tasks waiting for memory
    monkeypatch.setattr(cgroup, "stalled", (lambda: float(next(clock))) if host_stalls else (lambda: 0.0))

    reads = []

    def burn():  # a read costing CPU, as a page-table walk or a reclaim does
        reads.append(t := time.thread_time())
        while time.thread_time() - t < 2 * cgroup.SLOW:
            pass
        return 0

    async def main():
        killed = []

        async def kill(why):
            killed.append(why)

        cgroup.watch("read", burn, 1 << 30, kill)
        t0 = time.monotonic()
        while not killed and len(reads) < 2 and time.monotonic() - t0 < 30:  # the first read judged, a second begun
            await asyncio.sleep(0.01)
        cgroup.unwatch("read")
        return killed

    killed = asyncio.run(main())
    assert killed == ([] if host_stalls else [f"reading its memory cost the host 0.5 s of CPU (more than {cgroup.SLOW:g} s)"])


def test_the_memory_watch_reads_each_sandbox_on_its_own_so_a_slow_one_delays_no_other():
    """Issue 44: the watch read every sandbox in turn, so one slow to read (millions of mappings: seconds) delayed every
    other's limit by as much. Now each is read in a thread of its own: a sandbox past its limit beside one whose read
    takes 0.8 s (asleep: no CPU, not killed for its cost) is killed within the watch's wait for reads (0.25 s)."""
    import asyncio
    import time

    from l0_min.sandbox import cgroup

    async def main():
        killed, t0 = {}, time.monotonic()

        async def kill(name, why):
            killed[name] = (time.monotonic() - t0, why)

        cgroup.watch("slow", lambda: time.sleep(0.8) or 0, 1 << 30, lambda why: kill("slow", why))
        cgroup.watch("over", lambda: 2 << 30, 1 << 30, lambda why: kill("over", why))
        while "over" not in killed and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        cgroup.unwatch("slow")
        return killed

    killed = asyncio.run(main())
    assert list(killed) == ["over"] and killed["over"][1] == "the sandbox reached its memory limit (1,024 MB)", killed
    assert killed["over"][0] < 0.6, killed  # before: after the slow read, 0.8 s (asyncio.run then waits for it)
