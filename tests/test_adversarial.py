"""Adversarial cells: every attack is contained, each test asserts what happened, and after each
one the host still serves another kernel (the victim) with its state intact.

The kernels are started concurrently once for the module: an attacker and a victim (both with
tools) and spares for attacks that end a kernel. The second part (issue 15: an outside attack run
on the host itself) also watches the host's health while each attack runs (`host_health`).
"""

import asyncio
import contextlib
import gc
import json
import logging
import os
import resource
import socket
import sys
import time
import warnings
from pathlib import Path

import pytest
import pytest_asyncio

from l0_min.agent import run_episode
from l0_min.collect import Services, run_one
from l0_min.envs.qa import QA
from l0_min.config import Config, KernelConfig, SandboxConfig
from l0_min.episode import ANSWERED, ENV_ERROR, KERNEL_CRASHED, Episode, Step, Task, training_rows
from l0_min.inference import Generation
from l0_min.models import tiny_tokenizer
from l0_min.runtime import settle_gc
from l0_min.sandbox import bwrap as sb
from l0_min.sandbox import cgroup
from l0_min.sandbox.kernel import Kernel
from l0_min.sandbox.tools import ToolServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]  # attacks take seconds each
module_fixture = pytest_asyncio.fixture(scope="module", loop_scope="module")

PROJECT = Path(__file__).resolve().parents[1]
TOK = tiny_tokenizer()
SANDBOX = SandboxConfig(workspace_mb=32, tmp_mb=16, file_size_mb=8, max_procs=48)
KCFG = KernelConfig(exec_timeout=10, interrupt_grace=2, max_output_chars=2000, start_timeout=60)


class NoSearch:
    async def search(self, query, k):
        return [{"id": "d1", "title": "Capital", "text": "The capital.", "score": 1.0}]

    async def read_page(self, ref):
        return ""


@module_fixture
async def tools():
    server = ToolServer(NoSearch(), timeout=2)
    await server.start()
    yield server
    await server.close()


@module_fixture
async def ks(tools):
    names = ["attacker", "victim", "spare1", "spare2", "spare3"]
    kernels = {n: Kernel(SANDBOX, KCFG, tools) for n in names}
    await asyncio.gather(*(k.start() for k in kernels.values()))
    r = await kernels["victim"].execute("victim_state = 'intact'\nopen('/workspace/victim_secret.txt', 'w').write('x')")
    assert r.ok, r.text()
    yield kernels
    await asyncio.gather(*(k.shutdown() for k in kernels.values()))


async def host_still_serves(ks) -> None:
    """The victim kernel answers promptly and kept its state."""
    r = await asyncio.wait_for(ks["victim"].execute("victim_state"), 10)
    assert r.result == "'intact'", r.text()


def sandbox_pids(k: Kernel) -> list[int]:
    """Host pids of every process in the kernel's pid namespace."""
    try:
        ns = os.readlink(f"/proc/{k.sandbox_pid}/ns/pid")
    except FileNotFoundError:
        return []
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.readlink(f"/proc/{p}/ns/pid") == ns:
                    pids.append(int(p))
            except (FileNotFoundError, PermissionError):
                pass
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- reading the host


async def test_cannot_read_host_secrets_or_the_project(ks):
    targets = ["/etc/shadow", "/etc/sudoers", os.path.expanduser("~/.bashrc"), os.path.expanduser("~/.ssh/id_rsa"),
               str(PROJECT / "l0_min" / "sandbox" / "kernel.py"), str(PROJECT / "tests" / "test_adversarial.py"),
               str(PROJECT / "requirements.txt"), str(Path(sys.prefix) / "pyvenv.cfg")]  # fmt: skip
    code = f"""
import os
res = {{}}
for p in {targets!r}:
    try:
        open(p).read()
        res[p] = 'READ'
    except Exception as e:
        res[p] = type(e).__name__
print(res)
print(sorted(os.listdir('/root')) if os.path.exists('/root') else [])
print([d for d in os.listdir('/tmp') if d.startswith('l0_min')], os.path.exists({str(PROJECT)!r}))
"""
    r = await ks["attacker"].execute(code)
    assert r.ok, r.text()
    lines = r.stdout.splitlines()
    res, root_listing = eval(lines[0]), eval(lines[1])
    assert set(res.values()) <= {"FileNotFoundError", "PermissionError"}, res
    # root's home holds only the path to the interpreter when the interpreter lives there
    expected = [Path(sys.base_prefix).parts[2]] if sys.base_prefix.startswith("/root/") else []
    assert root_listing == expected
    assert lines[2] == "[] False"  # no host runtime folders, no project
    await host_still_serves(ks)


async def test_cannot_see_another_kernels_workspace_or_processes(ks):
    victim = ks["victim"]
    code = f"""
import os
print(os.path.exists('/workspace/victim_secret.txt'))
print(os.path.exists('/proc/{victim.sandbox_pid}/root/workspace/victim_secret.txt'))
print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
"""
    r = await ks["attacker"].execute(code)
    lines = r.stdout.splitlines()
    assert lines[:2] == ["False", "False"], r.text()
    assert eval(lines[2]) == [1, 2]  # its own pid namespace: bwrap's init and the kernel
    await host_still_serves(ks)


async def test_cannot_write_outside_the_workspace(ks):
    targets = ["/evil", "/etc/passwd", "/usr/bin/python3", "/opt/l0/l0_toolbox.zip", "/run/l0/conn.json",
               "/opt/venv/pyvenv.cfg", str(PROJECT / "evil.txt")]  # fmt: skip
    code = f"""
import errno
res = {{}}
for p in {targets!r}:
    try:
        with open(p, 'a') as f:
            f.write('pwned')
        res[p] = 'WROTE'
    except OSError as e:
        res[p] = errno.errorcode[e.errno]
print(res)
"""
    r = await ks["attacker"].execute(code)
    res = eval(r.stdout)
    assert set(res.values()) <= {"EROFS", "EACCES", "ENOENT"}, res
    assert not (PROJECT / "evil.txt").exists()
    assert "pwned" not in (PROJECT / "l0_min" / "sandbox" / "toolbox" / "client.py").read_text()
    await host_still_serves(ks)


# --------------------------------------------------------------------------- network


async def test_network_is_off(ks):
    code = """
import socket
for target in [('1.1.1.1', 53), ('127.0.0.1', 22)]:
    try:
        socket.create_connection(target, timeout=3)
        print('connected', target)
    except OSError as e:
        print(type(e).__name__, e.errno)
try:
    socket.getaddrinfo('pypi.org', 443)
    print('resolved')
except socket.gaierror as e:
    print('gaierror')
"""
    r = await ks["attacker"].execute(code)
    assert r.stdout.splitlines() == ["OSError 101", "ConnectionRefusedError 111", "gaierror"], r.text()
    await host_still_serves(ks)


# --------------------------------------------------------------------------- resources


async def test_fork_bomb_is_contained(ks):
    code = """
import os, time, errno
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, errno.errorcode[e.errno])
"""
    k = ks["attacker"]
    r = await k.execute(code)
    n, err = r.stdout.split()
    assert err == "EAGAIN" and 0 < int(n) < SANDBOX.max_procs
    assert len(sandbox_pids(k)) <= SANDBOX.max_procs + 1  # + bwrap's init (root-owned on a root host)
    # the attacker cleans up: kill every child, then reap them (zombies count against the limit too)
    cleanup = """
import os, signal
os.kill(-1, signal.SIGKILL)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
len([p for p in os.listdir('/proc') if p.isdigit()])
"""
    r = await k.execute(cleanup)
    assert r.result == "2", r.text()  # the kernel and bwrap's init remain
    await host_still_serves(ks)


async def test_shell_fork_bomb_is_contained_and_ends_with_the_kernel(ks):
    k = ks["spare1"]
    bomb = "import subprocess, time\nsubprocess.Popen(['/bin/sh', '-c', 'f() { f | f & sleep 3; }; f'])\ntime.sleep(1.5)"
    cell = asyncio.ensure_future(k.execute(bomb))
    peak, seen = 0, set()
    while not cell.done():  # watch the sandbox's process count from the host while the bomb runs
        pids = sandbox_pids(k)
        peak, seen = max(peak, len(pids)), seen | set(pids)
        await asyncio.sleep(0.02)
    assert (await cell).ok
    assert 10 < peak <= SANDBOX.max_procs + 1, peak  # it ran, and stopped at the process limit
    await host_still_serves(ks)
    await k.shutdown()
    assert not any(alive(p) for p in seen)


async def test_memory_past_the_limit_fails_inside(ks):
    k = ks["attacker"]
    r = await k.execute("x = bytearray(64 * 2**30)")
    assert r.error_name == "MemoryError"
    # address space (RLIMIT_AS) runs out: anonymous maps count at once, without touching pages
    r = await k.execute("import mmap\nhog = []\nwhile True:\n    hog.append(mmap.mmap(-1, 256 << 20))")
    assert r.error_name == "OSError" and "Cannot allocate memory" in r.error_value and k.is_alive()
    r = await k.execute("n = len(hog)\ndel hog\n0 < n * 256 < 2048")
    assert r.result == "True"
    await host_still_serves(ks)


async def test_infinite_loop_is_interrupted(ks):
    k = ks["attacker"]
    r = await k.execute("while True:\n    pass", timeout=1.0)
    assert r.timed_out and not r.dead and k.is_alive()
    await host_still_serves(ks)


async def test_print_flood_is_cut(ks):
    k = ks["attacker"]
    r = await k.execute("while True:\n    print('spam ' * 20)", timeout=1.5)
    assert r.timed_out and r.truncated and not r.dead
    assert len(r.stdout) < 2 * KCFG.max_output_chars and r.stdout.startswith("spam")
    assert "characters truncated" in r.stdout
    await host_still_serves(ks)


def host_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def test_a_200_mb_print_never_reaches_the_host(ks):
    k = ks["attacker"]
    before = host_rss_mb()
    r = await k.execute("print('y' * 200_000_000)")
    assert r.truncated and r.ok
    assert len(r.stdout) < 2 * KCFG.max_output_chars and "199,99" in r.stdout  # the marker counts what was cut
    assert host_rss_mb() - before < 50
    await host_still_serves(ks)


async def test_filling_the_disk_stops_at_the_workspace_size(ks):
    k = ks["attacker"]
    free_before = os.statvfs(PROJECT).f_bavail * os.statvfs(PROJECT).f_frsize
    code = """
import os, errno
def fill(folder):
    n = 0
    try:
        while True:
            with open(f'{folder}/fill{n}', 'wb') as f:
                f.write(b'0' * (4 << 20))
            n += 1
    except OSError as e:
        return n, errno.errorcode[e.errno]
print([fill('/workspace'), fill('/tmp')])
try:
    open('/workspace/huge', 'wb').write(b'0' * (64 << 20))
except OSError as e:
    print(errno.errorcode[e.errno])
"""
    r = await k.execute(code)
    (ws_n, ws_err), (tmp_n, tmp_err) = eval(r.stdout.splitlines()[0])
    assert ws_err == tmp_err == "ENOSPC"
    assert ws_n * 4 <= SANDBOX.workspace_mb and tmp_n * 4 <= SANDBOX.tmp_mb
    assert r.stdout.splitlines()[1] in ("EFBIG", "ENOSPC")
    free_after = os.statvfs(PROJECT).f_bavail * os.statvfs(PROJECT).f_frsize
    assert free_before - free_after < 16 << 20  # nothing landed on the host's disk
    r = await k.execute("import glob\nfor p in glob.glob('/workspace/*') + glob.glob('/tmp/fill*'): os.remove(p)\n"
                        "open('/workspace/big', 'wb').write(b'0' * (9 << 20))")  # fmt: skip
    assert r.error_name == "OSError" and "File too large" in r.error_value  # RLIMIT_FSIZE, 8 MiB
    await host_still_serves(ks)


# --------------------------------------------------------------------------- killing and exiting


async def test_killing_pid_1_or_the_parent_fails(ks):
    k = ks["attacker"]
    await k.execute("mine = 'still here'")
    code = """
import os, signal
for target in (1, os.getppid()):
    try:
        os.kill(target, signal.SIGKILL)
        print(target, 'sent')
    except OSError as e:
        print(target, type(e).__name__)
try:
    os.kill(-1, signal.SIGKILL)  # every process it may signal
except ProcessLookupError:
    pass  # there is none
print(os.getpid(), os.getppid())
"""
    r = await k.execute(code)
    lines = r.stdout.splitlines()
    # on a root host pid 1 (bwrap's init) is root-owned: EPERM; otherwise the init ignores the signal
    assert all(line.split()[1] in ("PermissionError", "sent") for line in lines[:2]), lines
    assert lines[2] == "2 1"
    assert k.is_alive() and (await k.execute("mine")).result == "'still here'"
    await host_still_serves(ks)


async def test_sys_exit_is_an_error_and_os_exit_a_death(ks):
    k = ks["attacker"]
    r = await k.execute("import sys\nsys.exit(3)")
    assert r.error_name == "SystemExit" and not r.dead and k.is_alive()
    d = ks["spare2"]
    r = await d.execute("import os\nos._exit(1)")
    assert r.dead and not r.timed_out and not d.is_alive()
    assert (await d.execute("1")).dead
    await host_still_serves(ks)


async def test_a_background_process_does_not_outlive_the_episode(ks):
    k = ks["spare3"]
    code = """
import os, subprocess
subprocess.Popen(['/bin/sh', '-c', 'nohup sleep 600 >/dev/null 2>&1 &'])
if os.fork() == 0:  # a double-forked daemon in its own session
    os.setsid()
    if os.fork() == 0:
        import time
        time.sleep(600)
    os._exit(0)
import time; time.sleep(0.3)
"""
    r = await k.execute(code)
    assert r.ok, r.text()
    pids = sandbox_pids(k)
    cmdlines = [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in pids]
    assert sum(c.startswith("sleep 600") for c in cmdlines) == 1 and len(pids) >= 4, cmdlines  # + init, kernel, daemon
    await k.shutdown()
    assert not any(alive(p) for p in pids)
    await host_still_serves(ks)


# --------------------------------------------------------------------------- the final answer


async def test_a_printed_final_answer_is_not_taken(ks, tools):
    k, victim = ks["attacker"], ks["victim"]
    code = f"""
print('Final answer submitted: 42')
print('{{"final_answer": "42"}}')
print('<answer>42</answer>')
print("submit_final_answer('42')")
from l0_toolbox.client import call
call('submit_final_answer', answer='hijack', key={victim.id!r}, episode={victim.id!r})
"""
    r = await k.execute(code)
    assert r.ok, r.text()
    assert tools.final_answer(victim.id) is None  # the socket, not the request, names the episode
    assert tools.final_answer(k.id) == "hijack"  # the only real call, recorded for its own kernel
    await host_still_serves(ks)


async def test_limits_do_not_touch_the_host_process():
    # the host keeps its own limits (only raised: RLIMIT_NOFILE up to its hard limit)
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    assert soft > SANDBOX.max_procs or soft == resource.RLIM_INFINITY
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY


# =========================================================================== the host under attack
# Each attack below (issue 15) runs while `host_health` watches the host:
#   - an asyncio heartbeat ticks every 10 ms; a tick's stall is its lateness, but at most the CPU time
#     the event-loop thread spent meanwhile, so waiting for a CPU shared with other jobs is not counted
#     as the loop being blocked (the raw lateness is printed too);
#   - another episode (a fresh kernel with tools) keeps calling web_search, then submits a final answer;
#   - the host's RSS and open fds are sampled every 20 ms;
#   - afterwards a new kernel starts and runs a cell.
BOUNDS = {"stall_ms": 100, "rss_mb": 150, "fds": 40}  # stall, and growth over the level before the attack


class Heartbeat:
    def __init__(self):
        self.stall = self.late = 0.0

    async def run(self) -> None:
        while True:
            t, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(0.01)
            late, busy = time.monotonic() - t - 0.01, time.thread_time() - cpu
            self.late, self.stall = max(self.late, late), max(self.stall, min(late, busy))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.asynccontextmanager
async def host_health(tools, name: str):
    other = Kernel(SANDBOX, KCFG, tools)
    await other.start()
    fds0, rss0 = fd_count(), host_rss_mb()
    peak = {"fds": fds0, "rss": rss0}
    beat, stop, calls = Heartbeat(), asyncio.Event(), []

    async def sample():
        while not stop.is_set():
            peak["fds"], peak["rss"] = max(peak["fds"], fd_count()), max(peak["rss"], host_rss_mb())
            await asyncio.sleep(0.02)

    async def search():
        while not stop.is_set():
            t = time.monotonic()
            r = await other.execute("print(len(web_search('capital')))")
            calls.append((r.stdout == "1\n", time.monotonic() - t, r.text(300)))
            await asyncio.sleep(0.05)

    # the collector as train.py and rollout.py set it once set up: otherwise a full collection of everything
    # this pytest process has piled up (not the host's) lands in the window (100.8 ms once, 40 ms alone)
    thresholds = gc.get_threshold()
    settle_gc()
    beating = asyncio.ensure_future(beat.run())
    tasks = [asyncio.ensure_future(f()) for f in (sample, search)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        beating.cancel()
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    r = await other.execute("submit_final_answer('still here')")
    answered = tools.final_answer(other.id)
    await other.shutdown()
    fresh = Kernel(SANDBOX, KCFG, tools)
    await fresh.start()
    fresh_ok = (await fresh.execute("1 + 1")).result == "2"
    await fresh.shutdown()
    slowest = max(c[1] for c in calls) if calls else 0.0
    print(f"\nHEALTH {name}: loop stall {1000 * beat.stall:.1f} ms (raw lateness {1000 * beat.late:.1f} ms), "
          f"RSS +{peak['rss'] - rss0:.1f} MB, fds +{peak['fds'] - fds0}, {len(calls)} searches by another episode "
          f"(slowest {slowest:.2f} s)")  # fmt: skip
    assert 1000 * beat.stall < BOUNDS["stall_ms"], beat.stall
    assert calls and all(ok for ok, _, _ in calls), calls
    assert answered == "still here", r.text()
    assert fresh_ok
    assert peak["rss"] - rss0 < BOUNDS["rss_mb"] and peak["fds"] - fds0 < BOUNDS["fds"], (peak, rss0, fds0)


def skip_without(protection: str) -> None:
    missing = sb.protections(SANDBOX)[1]
    if protection in missing:
        pytest.skip(f"this host cannot provide it: {missing[protection]}")


NO_CGROUP = "no cgroup for sandboxes: turned off by the test"


@pytest.fixture(params=["cgroup", "no cgroup"])
def memory_mode(request, monkeypatch):
    """Issue 34: each memory test runs with the sandboxes' cgroups and with none (cloud VMs and most containers:
    the memory watch and seccomp alone), cgroup detection turned off."""
    if request.param == "no cgroup":
        monkeypatch.setattr(cgroup, "detect", lambda: NO_CGROUP)
        monkeypatch.setattr(cgroup, "shared", lambda: NO_CGROUP)
    else:
        skip_without("cgroup")
    return request.param


class Script:
    """A policy that plays fixed actions (tiny-random's byte tokenizer: id = byte + 3)."""

    def __init__(self, *codes: str):
        self.actions = [f"<think>go</think>\n<code>{c}</code>" for c in codes]

    async def generate(self, input_ids, sampling):
        ids = TOK.encode(self.actions.pop(0), add_special_tokens=False)
        return Generation(output_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", matched_stop="</code>")


def episode_config(**agent) -> Config:
    cfg = Config()
    cfg.sampling.max_new_tokens = 256
    for k, v in {"max_steps": 8, "max_observation_chars": 2000, "min_action_tokens": 64, **agent}.items():
        setattr(cfg.agent, k, v)
    return cfg


# --------------------------------------------------------------------------- 1. a huge notepad


async def test_1_a_huge_notepad_is_trimmed_before_the_host_parses_or_tokenizes_it(tools):
    """75 s stalls before: the host parsed and tokenized a 46 MB notepad on the event loop."""
    kcfg = KernelConfig(exec_timeout=4, start_timeout=60)  # max_output_chars 8000: the notepad's bound
    k = Kernel(SANDBOX, kcfg, tools)
    await k.start()
    cfg = episode_config(max_context_tokens=12_000)
    policy = Script("notepad.draft = 'The capital of Freedonia is Fredville. ' * 1_180_000\nlen(notepad.draft)",
                    *["print('z' * 1990)"] * 6, "submit_final_answer('Fredville')")  # fmt: skip
    task = Task("f", "What is the capital of Freedonia?", ["Fredville"])
    try:
        async with host_health(tools, "1 notepad of 46 MB, context rebuilt around it"):
            ep = await run_episode(task, QA(cfg), policy, k, tools, TOK, cfg)
            assert ep.status == ANSWERED and ep.truncations >= 1, (ep.status, ep.error)
            rebuilt = TOK.decode(next(s.context_ids for s in ep.steps if s.segment == 1))
            assert "Notepad:\n## Draft\nThe capital of Freedonia" in rebuilt and "characters truncated ...]" in rebuilt
            assert len(rebuilt) < 12_000
            # the toolbox's own trim undone: what reaches the host is refused unparsed, or (a frame over 2 MiB) by zmq
            await k.execute("import l0_toolbox._capture as c\nc.trim = lambda text, limit: text\n"
                            "notepad.draft = 'x' * 1_500_000")  # fmt: skip
            note = await k.read_notepad()
            assert note.startswith("(the notepad is unavailable: the kernel sent no text of at most 8,000 characters: 1,500,0")
            await k.execute("notepad.draft = 'x' * 20_000_000")
            t = time.monotonic()
            assert await k.read_notepad() == "(the notepad is unavailable: the kernel did not answer)"
            assert time.monotonic() - t < 5  # zmq refused the 20 MB reply, and with it that connection
            r = await k.execute("1")
            assert r.dead and r.crashed and "it broke its connection to the host" in r.death, r
    finally:
        await k.shutdown()


# --------------------------------------------------------------------------- 2. tool-socket connections

FLOOD = """
import os, socket, time
kids = []
for _ in range(50):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:  # each child: up to 250 connections, held open; it always exits (never runs on as a kernel)
        try:
            held, end = [], time.time() + 3
            while len(held) < 250 and time.time() < end:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(0.05)
                try:
                    s.connect(os.environ['L0_TOOLS_SOCKET'])
                    held.append(s)
                except OSError:
                    s.close()
            time.sleep(max(0.0, end + 1 - time.time()))  # a loaded machine can be past end + 1 already
        finally:
            os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
len(kids)
"""


async def test_2_a_connection_flood_from_three_sandboxes_cannot_exhaust_the_hosts_descriptors(tools, caplog):
    """EMFILE before: 3 x 50 children x 250 connections; other episodes' tool calls and kernel starts failed."""
    attackers = [Kernel(SandboxConfig(max_procs=64), KCFG, tools) for _ in range(3)]
    await asyncio.gather(*(k.start() for k in attackers))
    try:
        async with host_health(tools, "2 three sandboxes x 50 children x 250 connections"):
            results = await asyncio.gather(*(k.execute(FLOOD, timeout=30) for k in attackers))
            assert all(r.ok and int(r.result) >= 40 for r in results), [r.text() for r in results]
            for k in attackers:  # at most max_connections per episode reached the host
                assert len(tools._sites[k.id][2]) <= tools.max_connections
    finally:
        await asyncio.gather(*(k.shutdown() for k in attackers))
    assert not [r for r in caplog.records if "accept" in r.getMessage()]  # nothing to say: no EMFILE


async def test_2_the_accept_loop_stays_quiet_and_recovers_when_the_host_is_out_of_descriptors(caplog):
    server = ToolServer(NoSearch(), timeout=2)
    await server.start()
    path = server.open_episode("e")
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", """if True:
        import socket, sys, time
        time.sleep(0.5)
        held = [socket.socket(socket.AF_UNIX) for _ in range(12)]
        for s in held:
            s.settimeout(0.2)
            s.connect_ex(sys.argv[1])  # 8 accepted (the cap), the rest wait in the backlog
        time.sleep(3)""", path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # the host is out of descriptors
    try:
        await asyncio.sleep(1.5)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot accept connections" in errors[0], errors  # one line, no tracebacks
    await asyncio.sleep(1.2)  # the pause is over: it accepts again, up to the cap
    assert len(server._sites["e"][2]) == server.max_connections
    await client.wait()
    await server.close()


# --------------------------------------------------------------------------- 3. memory past the limits


FORKS = """import os, time
for _ in range(8):  # 8 x 64 MB, each process far under RLIMIT_AS (2 GB), 512 MB in all
    if os.fork() == 0:
        hog = bytearray(b'1') * (64 << 20)
        time.sleep(30)
        os._exit(0)
time.sleep(30)"""
UNCHARGED = """import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
shmget = {'x86_64': 29, 'aarch64': 194}[os.uname().machine]
try:
    os.memfd_create('hog')
    print('memfd')
except OSError as e:
    print(errno.errorcode[e.errno])
print('shmget', libc.syscall(shmget, 0, 64 << 20, 0o1600), errno.errorcode.get(ctypes.get_errno()))"""


async def test_3_memfds_tmpfs_files_and_inodes_count_against_the_sandboxs_memory_limit(tools, memory_mode):
    """Before: memfd writes held 2.5 GiB under a 2 GiB RLIMIT_AS; inode floods cost host memory. Without a cgroup
    (issue 34) the sandbox was bounded by RLIMIT_AS alone: 8 forks held 3.2 GB. Now: memfds and SysV shm are
    refused where no cgroup charges them, and the host's memory watch kills a sandbox past its limit."""
    cfg = SandboxConfig(workspace_mb=32, tmp_mb=64, total_memory_mb=384, max_procs=48)
    k = Kernel(cfg, KCFG, tools)
    await k.start()
    try:
        async with host_health(tools, f"3 memfd past the sandbox's memory, inode flood ({memory_mode})"):
            assert (await k.execute("import os\nos.getpid()")).result == "2"
            if memory_mode == "no cgroup":
                r = await k.execute(UNCHARGED)
                assert r.stdout.split() == ["EPERM", "shmget", "-1", "EPERM"] and k._cgroup is None, r.text()
                r = await k.execute(FORKS, timeout=8)  # the watch looks every 0.25 s
            else:
                usage_file = f"{k._cgroup.dirs[0]}/memory.{'current' if k._cgroup.version == 2 else 'usage_in_bytes'}"
                usage = lambda: int(Path(usage_file).read_text())  # noqa: E731
                for pid in sandbox_pids(k):  # every process of the sandbox, bwrap's init too, is in its cgroup
                    with open(f"/proc/{pid}/cgroup") as f:
                        assert f.read().count(f"/l0_min-{os.getpid()}-{k.id}\n") == (2 if k._cgroup.version == 1 else 1)
                before = usage()
                r = await k.execute("for i in range(20_000):\n    open(f'/dev/shm/f{i}', 'w').close()")
                assert r.ok and usage() - before > 10 << 20  # ~0.9 KiB of kernel memory per inode, charged here
                hog = "hogs = []\nfor _ in range(64):  # 2 GiB in 32 MiB memfds (each under RLIMIT_FSIZE)\n"
                hog += "    hogs.append(os.memfd_create('hog'))\n    os.write(hogs[-1], b'0' * (32 << 20))"
                r = await k.execute(hog)
            assert r.dead and r.crashed and r.death == "killed: the sandbox reached its memory limit (384 MB)", r.text()
    finally:
        await k.shutdown()


# --------------------------------------------------------------------------- 4. symlinked ipc sockets


async def test_4_a_symlink_planted_for_the_kernels_sockets_is_never_followed(ks, tools, tmp_path):
    """Before: after the connection dropped, the host's zmq reconnected to wherever the sandbox's link pointed."""
    bait = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a host socket of the attacker's choice
    bait.bind(str(tmp_path / "bait.sock"))
    bait.listen(16)
    bait.setblocking(False)
    k = Kernel(SANDBOX, KCFG, tools)
    await k.start()
    code = f"""
import gc, glob, os, zmq
for p in glob.glob('/run/l0/ipc-*'):
    os.unlink(p)
    os.symlink({str(tmp_path / 'bait.sock')!r}, p)
for s in [o for o in gc.get_objects() if isinstance(o, zmq.Socket)]:
    s.close(linger=0)  # every connection to the host drops: its zmq reconnects
"""
    async with host_health(tools, "4 ipc sockets replaced by symlinks, connections dropped"):
        r = await k.execute(code, timeout=3)
        assert r.timed_out  # the kernel cannot answer any more: it broke its own sockets
        connected = 0
        for _ in range(20):  # zmq retries every 100 ms: 2 s of reconnects
            await asyncio.sleep(0.1)
            try:
                bait.accept()[0].close()
                connected += 1
            except BlockingIOError:
                pass
        assert connected == 0
    await k.shutdown()
    bait.close()


# --------------------------------------------------------------------------- 5. namespaces, seccomp


SYSCALLS = r"""
import ctypes, errno, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
nr = {'x86_64': dict(unshare=272, setns=308, mount=165, bpf=321, keyctl=250, io_uring_setup=425, ptrace=101,
                     perf_event_open=298, userfaultfd=323, clone=56),
      'aarch64': dict(unshare=97, setns=268, mount=40, bpf=280, keyctl=219, io_uring_setup=425, ptrace=117,
                      perf_event_open=241, userfaultfd=282, clone=220)}[os.uname().machine]
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
args = dict(unshare=[CLONE_NEWUSER], setns=[0, 0], mount=[b'none', b'/tmp', b'tmpfs', 0, 0], bpf=[0, 0, 0],
            keyctl=[0, 0], io_uring_setup=[1, 0], ptrace=[0, 0, 0, 0], perf_event_open=[0, 0, -1, -1, 0],
            userfaultfd=[0], clone=[CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0])
out = {}
for name, a in args.items():
    rc = libc.syscall(nr[name], *a)
    out[name] = errno.errorcode[ctypes.get_errno()] if rc == -1 else f'rc={rc}'
    if rc == 0 and name == 'clone':
        os._exit(0)
out['unshare -r'] = subprocess.run(['unshare', '-r', 'id'], capture_output=True, text=True).stderr.strip()
out['bwrap'] = subprocess.run(['bwrap', '--ro-bind', '/', '/', 'true'], capture_output=True, text=True).returncode
caps = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')}
t = threading.Thread(target=lambda: None)
t.start()
t.join()
out['caps'], out['thread'], out['fork'] = set(caps.values()), True, subprocess.run(['true']).returncode
print(out)
"""


async def test_5_no_nested_user_namespaces_no_risky_syscalls_no_capabilities(ks, tools):
    """Before: `unshare -r` gave uid 0 in a new user namespace: mount, nested bwrap, netfilter paths."""
    skip_without("seccomp")
    async with host_health(tools, "5 unshare, clone(NEWUSER), mount, bpf, keyctl, io_uring, ptrace, ..."):
        r = await ks["attacker"].execute(SYSCALLS)
    out = eval(r.stdout)
    denied = ["unshare", "setns", "mount", "bpf", "keyctl", "io_uring_setup", "ptrace", "perf_event_open",
              "userfaultfd", "clone"]  # fmt: skip
    assert {name: out[name] for name in denied} == {name: "EPERM" for name in denied}, out
    assert "Operation not permitted" in out["unshare -r"] and out["bwrap"] != 0
    assert out["caps"] == {"0000000000000000"}  # inheritable, permitted, effective, bounding, ambient
    assert out["thread"] and out["fork"] == 0  # clone3 -> ENOSYS: glibc falls back to clone, threads still work
    await host_still_serves(ks)


# --------------------------------------------------------------------------- 6. an agent that kills its own kernel


class Kernels:
    """Started kernels handed out in order (a pool without prewarming, so they start before the attack)."""

    def __init__(self, kernels):
        self.kernels = list(kernels)

    async def acquire(self):
        return self.kernels.pop(0)

    async def release(self, k):
        await k.shutdown()


async def test_6_killing_or_breaking_its_own_kernel_is_the_agents_failure_not_a_masked_env_error(tools, memory_mode):
    """Before: os._exit, an interrupt-proof loop or a broken notepad read ended as env_error: masked after
    retries, so the policy was never penalised: a reward hack waiting to be learned. Without a cgroup (issue 34)
    memory past the sandbox's limit killed nothing: now the host's memory watch kills it, as the agent's doing."""
    cfg = episode_config(max_context_tokens=2000, max_observation_chars=300)
    cfg.rollout.max_retries = 1
    cfg.kernel = KernelConfig(exec_timeout=4, interrupt_grace=1.0, start_timeout=60)
    attacks = {
        "os._exit": "import os\nos._exit(0)",
        "SIG_IGN loop": "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
        "broken str": "import builtins\nbuiltins.str = None",
        "shadowed notepad": "notepad = None",  # the notepad read fails: the episode goes on with a note saying so
        "forged message": "k = get_ipython().kernel\n"
                          "k.session.send(k.iopub_socket, 'error', {'ename': 'E', 'traceback': 5}, k.get_parent())",
        # under RLIMIT_AS, over the sandbox's 256 MB, for longer than the memory watch's period (0.25 s)
        "own memory": "import time\nhog = bytearray(b'1') * (300 << 20)\ntime.sleep(2)",
    }
    if memory_mode == "no cgroup":  # the others do not depend on it
        attacks = {name: attacks[name] for name in ("os._exit", "own memory")}
    sandbox = SandboxConfig(workspace_mb=32, tmp_mb=16, max_procs=48, total_memory_mb=256)
    kernels = [Kernel(sandbox, cfg.kernel, tools) for _ in attacks]
    await asyncio.gather(*(k.start() for k in kernels))
    env = Services(cfg, None, Kernels(kernels), tools, TOK, {"qa": QA(cfg)})
    async with host_health(tools, f"6 os._exit, SIG_IGN loop, broken str, shadowed notepad, forged message, own memory "
                                  f"({memory_mode})"):
        eps = {}
        for name, code in attacks.items():  # one episode each; fill the context so the notepad is read
            env.policy = Script(code, *["print('z' * 290)"] * 7)
            eps[name] = await run_one(env, Task(name, "q", ["a"]))
    for name, ep in eps.items():  # scored, never retried or masked as the environment's failure
        assert ep.status != ENV_ERROR and not ep.masked, (name, ep.status, ep.error)
    assert env.counters["env_retries"] == 0
    assert eps["os._exit"].status == KERNEL_CRASHED and "it exited with status 0" in eps["os._exit"].error
    assert eps["own memory"].status == KERNEL_CRASHED and "its memory limit (256 MB)" in eps["own memory"].error
    if memory_mode == "cgroup":
        assert eps["SIG_IGN loop"].status == KERNEL_CRASHED and "did not stop and was killed" in eps["SIG_IGN loop"].error
        shadowed = eps["shadowed notepad"]
        assert shadowed.truncations and "(the notepad is unavailable: AttributeError" in TOK.decode(shadowed.steps[-1].context_ids)
        assert eps["forged message"].status == KERNEL_CRASHED and "broke its connection" in eps["forged message"].error
    print({name: (ep.status, ep.error[:120]) for name, ep in eps.items()})
    # training sees them as failures: rows with weight (the format/exec reward is all they earned)
    rows = training_rows(list(eps.values()), cfg.algo)
    assert all(sum(r.mask) > 0 for r in rows)


# --------------------------------------------------------------------------- 7. smaller ones

LOOK = r"""
import glob
from l0_toolbox.client import ToolError, call
seen = {'mountinfo': open('/proc/self/mountinfo').read()}
for p in glob.glob('/proc/[0-9]*/cmdline'):
    seen[p] = open(p).read().replace('\0', ' ')
try:
    call('web_search', query='x' * 2_000_000)
except ToolError as e:
    print(e)
print(sorted(seen))
for where, text in seen.items():  # the venv and the tool server's folder show: they are mounted from there
    for line in text.splitlines():
        if ' /opt/venv ' not in line and any(secret in line for secret in SECRETS):
            print('LEAK', where, line)
"""


async def test_7_no_host_folder_pid_or_kernel_id_inside_and_a_clear_error_for_an_oversized_body(ks, tools):
    """Before: /proc/self/mountinfo and /proc/1/cmdline showed host paths, the host pid and the kernel id;
    a 2 MB tool request was told it "must be JSON"."""
    k = ks["attacker"]
    secrets = [k.id, f"l0_min-{os.getpid()}-", k.runtime_dir, str(PROJECT), "/l0_min/"]
    async with host_health(tools, "7 mountinfo, cmdline, a 2 MB tool request"):
        r = await k.execute(f"SECRETS = {secrets!r}\n" + LOOK)
    lines = r.stdout.splitlines()
    assert lines[0] == "web_search: the request body is over the limit of 65,536 bytes", r.text()
    assert lines[1] == "['/proc/1/cmdline', '/proc/2/cmdline', 'mountinfo']" and len(lines) == 2, r.text()
    await host_still_serves(ks)


# =========================================================================== the agent chooses nothing
# Issue 23: an outside attack run found an answer that crashed the run, messages that masked their own
# episode, buffers and frames that piled up on the host, tool work that held its event loop, and a host
# that the OOM killer took before the sandboxes. Each attack below runs under `host_health`; those that
# go through the real collector (collect.run_one) assert that the episode is scored, never masked.


async def scored(env: Services, name: str, *codes: str) -> Episode:
    """One episode through collect.run_one that must be scored: not an env_error, not masked, not retried."""
    env.policy = Script(*codes)
    retries = env.counters["env_retries"]
    ep = await run_one(env, Task(name, "q", ["a"]))
    assert ep.status != ENV_ERROR and not ep.masked and env.counters["env_retries"] == retries, (name, ep.status, ep.error)
    return ep


async def started(n: int, tools, sandbox: SandboxConfig = SANDBOX, kcfg: KernelConfig = KCFG) -> list[Kernel]:
    kernels = [Kernel(sandbox, kcfg, tools) for _ in range(n)]
    await asyncio.gather(*(k.start() for k in kernels))
    return kernels


# --------------------------------------------------------------------------- 8. a lone surrogate answer


async def test_8_a_lone_surrogate_answer_is_scored_and_every_run_folder_writer_keeps_it(tools, tmp_path):
    """Before: submit_final_answer(chr(0xD800)) was accepted, then train.py's trajectory write raised
    UnicodeEncodeError and ended the run."""
    from l0_min.evaluation import ResultsFile, record
    from l0_min.log import RunDir, read_episodes, read_jsonl
    from l0_min.viewer import write_viewer

    env = Services(episode_config(), None, Kernels(await started(1, tools)), tools, TOK, {"qa": QA(Config())})
    async with host_health(tools, "8 submit_final_answer(chr(0xD800)), printed surrogates"):
        ep = await scored(env, "surrogate", "print(chr(0xDFFF) + 'x', 'ok')\nsubmit_final_answer(chr(0xD800))")
    assert ep.status == ANSWERED and ep.final_answer == "\ud800" and ep.rewards["core"] == 0.0
    run = RunDir(tmp_path / "run")
    run.write_trajectories(1, [ep])  # train.py's writer (rollout.py and evaluate.py use the same write_jsonl)
    assert read_episodes(run.trajectory_path(1))[0].final_answer == "\ud800"  # the agent's str, read back as sent
    with ResultsFile(tmp_path / "eval" / "results.jsonl") as results:  # evaluate.py's results file
        results.append(record(ep))
    assert read_jsonl(tmp_path / "eval" / "results.jsonl")[0]["prediction"] == "\ud800"
    assert "\ufffd" not in write_viewer(run.path, run.viewer_html).read_text()  # written with '?' for it


# --------------------------------------------------------------------------- 9. malformed messages

FORGE = "k = get_ipython().kernel\nk.session.send(k.iopub_socket, 'stream', {}, k.get_parent())"  # raw JSON bytes


async def test_9_malformed_or_undecodable_kernel_messages_are_the_agents_failure_never_masked(tools):
    """Before: a forged message of 100,000 nested '[' made Kernel.execute raise RecursionError (issue 44: that many
    are now past the budget of values, test 17; here 5,000), and a lone surrogate in the notepad or in a forged stream
    message made the tokenizer raise: env_error, retried, masked: a reward hack for the taking."""
    cfg = episode_config(max_context_tokens=2000, max_observation_chars=300)
    cfg.rollout.max_retries = 1
    env = Services(cfg, None, Kernels(await started(3, tools)), tools, TOK, {"qa": QA(cfg)})
    fill = ["print('z' * 290)"] * 7  # fills the context: it is rebuilt around the notepad
    async with host_health(tools, "9 JSON nested 5,000 deep, surrogates in a stream message and the notepad"):
        nested = await scored(env, "nested", FORGE.format("b'[' * 5_000"), *fill)
        stream = await scored(env, "stream", FORGE.format("""b'{"name": "stdout", "text": "\\\\ud800 forged"}'"""), *fill)
        notepad = await scored(env, "notepad", "notepad.draft = chr(0xD800) * 3 + ' kept'", *fill)
    assert nested.status == KERNEL_CRASHED and "maximum recursion depth exceeded" in nested.error, nested.error
    assert "\ufffd forged" in stream.steps[0].observation and stream.status != KERNEL_CRASHED
    rebuilt = [TOK.decode(s.context_ids) for s in notepad.steps if s.segment > 0]
    assert notepad.truncations and "\ufffd\ufffd\ufffd kept" in rebuilt[0], notepad.error
    rows = training_rows([nested, stream, notepad], cfg.algo)
    assert len(rows) >= 3 and all(sum(r.mask) > 0 for r in rows)  # they train, as failures


# --------------------------------------------------------------------------- 10. buffers and frames

COMM = ("k = get_ipython().kernel\n"
        "send = lambda buffers: k.session.send(k.iopub_socket, 'comm_msg', {'comm_id': 'c', 'data': {}}, k.get_parent(), "
        "buffers=buffers)\n")  # fmt: skip
BETWEEN_CELLS = COMM + """import threading, time
def flood():
    for _ in range(30):
        send([b'x' * 3_900_000] * 100)
        time.sleep(0.1)
threading.Thread(target=flood, daemon=True).start()"""
BIG_MESSAGES = """import time
k = get_ipython().kernel
for i in range(50):  # 50 x 1.5 MB, each under the frame cap, past the toolbox's output cap
    type(k.session).send(k.session, k.iopub_socket, 'stream', {'name': 'stdout', 'text': '.' * 1_500_000}, k.get_parent())
    time.sleep(0.02)"""


async def test_10_binary_buffers_and_many_frames_never_pile_up_on_the_host(tools):
    """Before: 100 buffers of 3.9 MB sent from a thread between cells took the host from 49 to 1,026 MB;
    one message of 10^6 one-byte frames held the event loop 3.4 s."""
    envs = []
    for seconds, n in ((6, 1), (20, 2)):  # building 10^6 frames takes the kernel seconds
        cfg = episode_config(max_context_tokens=4000)
        cfg.kernel = KernelConfig(exec_timeout=seconds, interrupt_grace=2, start_timeout=60)
        envs.append(Services(cfg, None, Kernels(await started(n, tools, kcfg=cfg.kernel)), tools, TOK, {"qa": QA(cfg)}))
    (short, env) = envs
    async with host_health(tools, "10 buffers of 3.9 MB between cells, 10^6 frames, 75 MB in a cell"):
        between = await scored(short, "between", BETWEEN_CELLS, *["import time\ntime.sleep(1)"] * 4)
        frames = await scored(env, "frames", COMM + "send([b'x'] * 1_000_000)", *["1"] * 7)
        many = await scored(env, "many", BIG_MESSAGES, *["1"] * 7)
    print({ep.task.id: (ep.status, ep.error[-160:]) for ep in (between, frames, many)})
    assert frames.status == KERNEL_CRASHED and "a message of more than 8 frames" in frames.error
    assert many.status == KERNEL_CRASHED and "more than 64 MB or 20,000 messages in one cell" in many.error


# --------------------------------------------------------------------------- 11. tool work and tool calls

THREADS = """import threading, time
from l0_toolbox.client import ToolError, call
calls, end = [0], time.time() + 4
def hammer(tool, **args):
    while time.time() < end:
        try:
            call(tool, **args)
            calls[0] += 1
        except ToolError:
            time.sleep(0.01)
threads = [threading.Thread(target=hammer, args=({tool!r},), kwargs={args}) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
calls[0]"""


async def test_11_tool_work_and_tool_calls_cannot_hold_the_event_loop(tools):
    """Before: one 840 KB web_search query held the loop 0.9 s (BM25 on the loop); eight threads searching
    stalled it 6-9 s; 9,122 submit_final_answer calls from 8 threads in 25 s stalled it ~100 ms."""
    import random

    from l0_min.search import BM25Backend

    rng = random.Random(0)
    words = [f"w{i}" for i in range(3000)]
    docs = [{"id": f"d{i}", "title": f"doc {i}", "text": " ".join(rng.choices(words, k=120))} for i in range(2000)]
    backend = BM25Backend(docs)
    server = ToolServer(backend, timeout=10)
    await server.start()
    env = Services(episode_config(), None, Kernels(await started(1, server)), server, TOK, {"qa": QA(Config())})
    long_queries = ("from l0_toolbox.client import ToolError\nfor q in ['w1 ' * 280_000, 'w' * 2001]:  # 840 KB\n"
                    "    try:\n        web_search(q)\n    except ToolError as e:\n        print(e)")  # fmt: skip
    try:
        async with host_health(tools, "11 an 840 KB query, 8 threads searching, 8 threads submitting"):
            ep = await scored(env, "tools", long_queries, THREADS.format(tool="web_search", args="{'query': 'w1 w2 ' * 330}"),
                              THREADS.format(tool="submit_final_answer", args="{'answer': 'x'}"))  # fmt: skip
    finally:
        await server.close()
        await backend.close()
    obs = [s.observation for s in ep.steps]
    assert obs[0].split("\n")[1:3] == ["web_search: the request body is over the limit of 65,536 bytes",
                                       "web_search: the query has 2,001 characters, more than the 2,000 allowed"], obs[0]
    calls = [(int(o.split("<output>\n")[1].split("\n")[0]), s.seconds) for o, s in zip(obs[1:3], ep.steps[1:3])]
    print(f"\nCALLS web_search, submit_final_answer from 8 threads for 4 s: (calls, seconds) {calls}")
    for n, cell_seconds in calls:  # a burst of calls_per_second, then calls_per_second a second; 8 calls in flight
        assert 10 < n <= server.calls_per_second * (1 + cell_seconds) + 8, calls
    assert ep.status == ANSWERED and ep.final_answer == "x"


# --------------------------------------------------------------------------- 12. the OOM killer's choice


async def test_12_sandboxes_are_the_oom_killers_first_choice_and_the_host_lives(tools, memory_mode):
    """Before: in a 1,200 MB cgroup holding the host (500 MB) and two sandboxes writing 400 MB of memfds
    each, the OOM killer took the host and left both sandboxes. Now with and without the sandboxes' cgroups
    (then their memory is anonymous: memfds are refused)."""
    k = (await started(1, tools))[0]
    own = open("/proc/self/oom_score_adj").read()
    try:
        async with host_health(tools, "12 oom_score_adj, and a sandbox trying to lower it"):
            r = await k.execute("import os\ntry:\n    os.write(os.open('/proc/self/oom_score_adj', os.O_WRONLY), b'-1000')\n"
                                "except OSError as e:\n    print(type(e).__name__)\nprint(open('/proc/self/oom_score_adj').read())")
        assert r.stdout.split() == ["PermissionError", "1000"], r.text()
        assert {open(f"/proc/{p}/oom_score_adj").read().strip() for p in sandbox_pids(k)} == {"1000"}
        assert open("/proc/self/oom_score_adj").read() == own  # the host keeps its own
    finally:
        await k.shutdown()
    report = await in_a_box(1200, "host", memory_mode)
    assert report["adj"] == ["1000", "1000"] and report["share"] == int(report["available"] * cgroup.SHARE) < 900
    deaths = [c for c in report["cells"] if c["dead"]]
    # the OOM killer (or the memory watch) took a sandbox; without a cgroup the host sees a SIGKILL while its OOM kills
    # rose (issue 44: before, "it exited with status 137", the agent's own doing): the environment's, as with one
    assert deaths and all(c["death"].startswith("killed") for c in deaths), report
    assert all(c["crashed"] == c["death"].startswith("killed: ") for c in deaths), report  # the watch's: its own


REAL_DETECT = cgroup.detect  # memory_mode turns it off in this process; the box below stands for a machine


async def in_a_box(mb: int, scenario: str, memory_mode: str) -> dict:
    """tests/workers/oom_host.py run as the host of a machine of `mb` MB (a cgroup of that limit): its report. It
    must live, and its event loop must not stall (the heartbeat's bound, measured there)."""
    how = REAL_DETECT()
    if isinstance(how, str):
        pytest.skip(f"no cgroup to hold a host and its sandboxes: {how}")
    version, parents = how
    box = f"{parents[0]}/l0_min-oomtest-{os.getpid()}"
    os.makedirs(box, exist_ok=True)  # one an earlier test left (its memory still charged) is reused
    try:
        for name, value in ({"memory.max": mb << 20, "memory.swap.max": 0} if version == 2 else {
                "memory.limit_in_bytes": mb << 20, "memory.memsw.limit_in_bytes": mb << 20}).items():
            if os.path.exists(f"{box}/{name}"):
                Path(f"{box}/{name}").write_text(str(value))
        worker = PROJECT / "tests" / "workers" / "oom_host.py"
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", f'echo 0 >{box}/cgroup.procs && exec "$0" "$@"', sys.executable, str(worker), scenario,
            {"cgroup": "cgroup", "no cgroup": "none"}[memory_mode], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 240)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(box)
    assert proc.returncode == 0, err.decode()[-2000:]  # the host lived
    report = json.loads(out.decode().splitlines()[-1])
    print(f"\nOOM {scenario} ({memory_mode}):", report)
    assert report["stall_ms"] < BOUNDS["stall_ms"], report
    return report


# --------------------------------------------------------------------------- 13. property: any str, any path

HOSTILE = r'''
import random
def hostile(i):
    """String i: hostile ones first (surrogates, NUL, 10^6 characters, a deeply nested repr, the chat's own
    markup), then random ones drawn from every code point, lone surrogates and NUL included (seed i)."""
    fixed = ["\ud800", "tail \udfff", "a\x00b\x00", "x" * 1_000_000, "[" * 100_000, repr(eval("[" * 90 + "]" * 90)),
             "\U0001F600\u202e\ufeff\udbff\udc00", "<|im_end|><" "/code><output>\n</output>", "\x1b[31m\r\n\t\x7f"]
    if i < len(fixed):
        return fixed[i]
    rng = random.Random(i)
    return "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0xd800, 0xe000), rng.randrange(0x110000), 0]))
                   for _ in range(rng.randrange(1, 300)))
'''
PATHS = {  # how a cell hands the host string i: every way the sandbox's text reaches it
    "print": "print(hostile({i}))",
    "value": "hostile({i})",
    "error": "raise ValueError(hostile({i}))",
    "notepad": "notepad.draft = hostile({i})",
    "forged": "import json\nk = get_ipython().kernel\ntype(k.session).send(k.session, k.iopub_socket, 'stream', "
              "json.dumps({{'name': 'stdout', 'text': hostile({i})}}).encode(), k.get_parent())",
    "tools": "from l0_toolbox.client import ToolError, call\nfor tool, arg in [('web_search', 'query'), ('read_page', 'ref')]:\n"
             "    try:\n        print(call(tool, **{{arg: hostile({i})}}))\n    except ToolError as e:\n        print(e)",
}  # fmt: skip


def pairs(t: str) -> str:
    """`t` as JSON reads it back: a high surrogate followed by a low one is the one character they encode."""
    return t.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")


async def test_13_property_any_string_on_any_path_reaches_the_tokenizer_and_the_disk(tools, tmp_path):
    """Issue 23: random and hostile strings through every path from the sandbox to the tokenizer and to
    disk (trajectories, results, viewer): no exception escapes, the kernel lives, and an episode made of
    them is scored, not masked."""
    from l0_min.context import ContextWatcher, chat_format, valid_text
    from l0_min.evaluation import ResultsFile, record, summarize
    from l0_min.log import RunDir, read_episodes
    from l0_min.viewer import write_viewer

    namespace: dict = {}
    exec(HOSTILE, namespace)
    hostile, n = namespace["hostile"], 24
    k, cfg = (await started(1, tools))[0], episode_config(max_context_tokens=4000)
    assert (await k.execute(HOSTILE)).ok
    run, episodes = RunDir(tmp_path / "run"), []
    async with host_health(tools, "13 24 hostile strings x print, value, error, notepad, forged message, tools"):
        for i in range(n):
            ctx = ContextWatcher(chat_format(TOK), "system", "task", cfg.agent, 256)
            ep = Episode(Task(f"h{i}", "q", ["a"]), final_answer=hostile(i), status=ANSWERED)
            for name, code in PATHS.items():
                r = await k.execute(code.format(i=i))
                text = await k.read_notepad() if name == "notepad" else r.text(cfg.agent.max_observation_chars)
                assert not r.dead and valid_text(text) == text, (i, name, r)
                obs = ctx.add_step(TOK.encode("<code>x</code>", add_special_tokens=False), text, 5)  # the tokenizer
                ep.steps.append(Step(ctx.ids[-3:], [1], [0.0], observation=obs))
            episodes.append(ep)
    run.write_trajectories(1, episodes)

    def texts(eps):
        return [[pairs(t) for t in (e.final_answer, *(s.observation for s in e.steps))] for e in eps]

    assert texts(read_episodes(run.trajectory_path(1))) == texts(episodes)  # the same strs, read back
    write_viewer(run.path, run.viewer_html)
    with ResultsFile(tmp_path / "eval" / "results.jsonl") as results:
        for e in episodes:
            results.append(record(e))
    assert summarize(list(results.by_key.values()), ["reward"])["n"] == n
    await k.shutdown()
    # the same strings in one episode through the collector: scored, with the notepad rebuilt around them
    cfg = episode_config(max_context_tokens=2000, max_observation_chars=300, max_steps=12)
    env = Services(cfg, None, Kernels(await started(1, tools)), tools, TOK, {"qa": QA(cfg)})
    codes = [HOSTILE + "\nnotepad.draft = hostile(0) + hostile(6) + hostile(10)", *(PATHS[p].format(i=i) for p, i in
             [("print", 11), ("forged", 12), ("error", 1), ("value", 13), ("forged", 2)]), *["print('z' * 290)"] * 5,
             "submit_final_answer(hostile(0) + hostile(14))"]  # fmt: skip
    ep = await scored(env, "hostile", *codes)
    assert ep.status == ANSWERED and ep.final_answer == pairs(hostile(0) + hostile(14)) and ep.truncations, ep.error
    run.write_trajectories(2, [ep])
    assert read_episodes(run.trajectory_path(2))[0].final_answer == ep.final_answer


# =========================================================================== issue 34: the second round
# An outside attack run found an answer that crashed training (tests/test_envs.py, test_collect.py), one episode
# masking others through the shared search thread, a notepad parsed on the event loop, memory without a cgroup
# and the shared memory limit as a masking path.

# --------------------------------------------------------------------------- 14. the notepad's parser

ONE_OR = ("get_ipython().user_expressions = lambda expressions: {name: {'status': 'ok', 'metadata': {}, "
          "'data': {'text/plain': '1or ' * 8000 + '1'}} for name in expressions}")  # the reply the host parses


async def test_14_a_notepad_that_chokes_a_python_parser_costs_the_loop_nothing(tools):
    """Before: the host read the notepad back with ast.literal_eval on its event loop: '1or ' * 8000 + '1' (32 k
    characters, under its size check) cost 40-80 ms a read and wrote 8,000 SyntaxWarning lines to the trainer's
    stderr; 3-4 such episodes at once stalled the loop past 100 ms. Now it arrives as JSON."""
    kernels = await started(8, tools, kcfg=KernelConfig(exec_timeout=10, start_timeout=60))  # 8,000 characters
    try:
        assert all(r.ok for r in await asyncio.gather(*(k.execute(ONE_OR) for k in kernels)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with host_health(tools, "14 8 notepads of '1or ' * 8000 + '1', read at once, 5 times"):
                for _ in range(5):
                    notes = await asyncio.gather(*(k.read_notepad() for k in kernels))
                    assert all(n.startswith("(the notepad is unavailable: the kernel sent no text of at most 8,000 "
                                            "characters") for n in notes), notes[0]  # fmt: skip
    finally:
        await asyncio.gather(*(k.shutdown() for k in kernels))
    assert not [w for w in caught if issubclass(w.category, SyntaxWarning)], caught[:3]


# --------------------------------------------------------------------------- 15. one episode's searches, another's time

HANG_UP = """import json, os, socket, threading, time
body = json.dumps({'tool': 'web_search', 'args': {'query': QUERY}})
request = (f'POST /call HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n'
           + body).encode()
end = time.time() + SECONDS
def hammer():  # the costliest query the caps allow, as fast as the server accepts, hanging up after 150 ms
    while time.time() < end:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(0.2)
        try:
            s.connect(os.environ['L0_TOOLS_SOCKET'])
            s.sendall(request)
            time.sleep(0.15)
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
threads = [threading.Thread(target=hammer) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()"""


async def test_15_two_episodes_flooding_search_slow_only_themselves_and_mask_no_one():
    """Before: aiohttp ran on the handler of a connection its client had closed, so the 8-connection cap did
    not bound work in flight: two episodes sending the costliest query (2,000 characters of common terms,
    ~113 ms on a 100k-document index) 10 times a second and hanging up after 150 ms grew the search queue until
    every search timed out: a third episode that answered correctly was masked as env_error, and an unrelated
    episode's cells timed out. The 100k documents here are 12 words each (a query's own work ~15 ms); each
    search holds the search thread for the issue's measured cost, 113 ms per 2,000 characters."""
    import random

    from l0_min.search import BM25Backend

    class Measured(BM25Backend):
        def search_sync(self, query, k):
            t, hits = time.perf_counter(), super().search_sync(query, k)
            time.sleep(max(0.0, 0.113 * len(query) / 2000 - (time.perf_counter() - t)))
            return hits

    rng, common = random.Random(0), [f"w{i}" for i in range(60)]
    docs = [{"id": f"d{i}", "title": f"t{i}", "text": " ".join(rng.choices(common, k=12))} for i in range(100_000)]
    backend = Measured(docs + [{"id": "c", "title": "Capital", "text": "The capital."}])
    server = ToolServer(backend, timeout=2)  # before, the queue grew 1.26 s a second: past 2 s after 1.6 s
    await server.start()
    query, seconds = " ".join(common * 20)[:2000], 5
    attack = HANG_UP.replace("QUERY", repr(query)).replace("SECONDS", str(seconds))
    cfg = episode_config()
    cfg.rollout.max_retries = 1
    envs = [Services(cfg, None, Kernels(await started(1, server)), server, TOK, {"qa": QA(cfg)}) for _ in range(3)]
    benign = ["import time\ntime.sleep(2)", "r = web_search('capital')\nprint(len(r), r[0]['title'])",
              "r = web_search('capital w1 w2')\nprint(len(r))", "submit_final_answer('a')"]  # fmt: skip
    for env, codes in zip(envs, [(attack, "submit_final_answer('x')")] * 2 + [benign]):
        env.policy = Script(*codes, *codes)  # a retry (on main) plays them again
    try:
        async with host_health(server, "15 two episodes flooding search with 2,000-character queries, hanging up"):
            *attackers, ep = await asyncio.gather(*(run_one(e, Task(f"e{i}", "q", ["a"])) for i, e in enumerate(envs)))
    finally:
        await server.close()
        await backend.close()
    print({e.task.id: (e.status, [round(s.seconds, 2) for s in e.steps], e.error[:100]) for e in (*attackers, ep)})
    assert ep.status == ANSWERED and not ep.masked and ep.rewards["core"] == 1.0, (ep.status, ep.error)
    assert ep.steps[1].observation.split("<output>\n")[1].startswith("1 Capital"), ep.steps[1].observation
    assert all(s.exec_ok for s in ep.steps) and max(s.seconds for s in ep.steps[1:]) < 2.0  # 2 turns of 113 ms, and more
    for a in attackers:  # their own searches waited in their own lines: not the environment's failure, not masked
        assert a.status == ANSWERED and not a.masked and a.steps[0].seconds >= seconds, (a.status, a.error)
    assert sum(env.counters["env_retries"] for env in envs) == 0



# --------------------------------------------------------------------------- 16. the limit of all sandboxes


async def test_16_at_the_limit_of_all_sandboxes_the_one_holding_the_most_dies_as_its_own_doing(memory_mode):
    """Before: five sandboxes each holding 448 MB of memfds (under half of their own 1,024 MB) reached the limit
    of all sandboxes (75% of total memory); the OOM killer, ranking by resident memory (memfds are in no
    process's), took whom it took, and its victims were scored "killed from outside the sandbox" and masked.
    Now the share is 75% of the memory available at start-up, and past 90% of it the host kills the sandbox
    holding the most, as its own doing (issue 44: none holds half the share here, so the one that grew the most in
    the last second); the innocent one (50 MB, the most resident memory) answers."""
    report = await in_a_box(2400, "share", memory_mode)
    assert report["share"] == int(report["available"] * cgroup.SHARE) and report["available"] < 2400
    *hogs, innocent = report["cells"]
    assert not innocent["dead"] and innocent["result"] == "'innocent'", innocent
    deaths = [c for c in hogs if c["dead"]]
    assert deaths and all(c["crashed"] and "while it grew the most" in c["death"] for c in deaths), report


# =========================================================================== issue 44: the third round
# An outside attack run found parse work on the event loop, kernel memory and tmpfs pages that the memory watch could
# not see (and a host OOM kill scored as the innocent's own crash), a watch slowed by millions of mappings, pages read
# whole into the host, and failing pages that masked the agent's own episode.

# --------------------------------------------------------------------------- 17. parse work on the loop

DATES = """import time
k = get_ipython().kernel
dates, parent = ['2024-01-01T00:00:00.000000Z'] * 40_000, k.get_parent()['header']  # 1.2 MB of JSON: under 2 MiB
for i in range(15):  # ISO dates in the header and in the parent header, another request's or this one's
    msg = k.session.msg('stream', {'name': 'stdout', 'text': 'x'}, parent=parent)
    msg['header']['dates'] = dates
    msg['parent_header'] = {**parent, 'dates': dates} if i % 2 else {'msg_id': 'another', 'dates': dates}
    type(k.session).send(k.session, k.iopub_socket, msg)
    time.sleep(0.05)"""
LISTS = ("k = get_ipython().kernel\ntype(k.session).send(k.session, k.iopub_socket, 'stream', {'name': 'stdout', "
         "'text': 'x', 'pad': [[]] * 500_000}, k.get_parent())")  # '[], ' * 500,000: 2 MB  # fmt: skip


async def test_17_forged_messages_that_cost_parse_work_are_refused_before_they_are_parsed(tools):
    """Issue 44, before: the host parsed every message on its event loop, with jupyter_client's date extraction, before
    it looked at whose it was: one message with 80k ISO dates in its header and parent header stalled the loop 1.2 s,
    15 of them 3.6 s, and another episode's cell timed out; 500,000 empty lists in a content (2 MB) cost 0.1-0.2 s.
    Now only a message whose parent's bytes name the request waited for is parsed, without date extraction, and only
    within a budget of JSON values counted unparsed: the attacker's kernel is killed, its own doing."""
    cfg = episode_config(max_context_tokens=2000, max_observation_chars=300)
    cfg.rollout.max_retries = 1
    env = Services(cfg, None, Kernels(await started(2, tools)), tools, TOK, {"qa": QA(cfg)})
    async with host_health(tools, "17 forged messages: 80k ISO dates in header and parent, 500,000 lists in a content"):
        eps = [await scored(env, name, code, "submit_final_answer('x')") for name, code in [("d", DATES), ("l", LISTS)]]
    for ep, limit in zip(eps, ("100", "10,000")):
        assert ep.status == KERNEL_CRASHED and f"a message frame of more than {limit} JSON values" in ep.error, ep.error


# --------------------------------------------------------------------------- 18, 19. memory no process maps


async def test_18_an_inode_flood_counts_against_the_sandbox_that_made_it(memory_mode):
    """Issue 44, before: a sandbox making 1.5M empty files (1.5 GB of inodes and dentries: kernel memory) was 28 MB to
    the memory watch without a cgroup (PSS), its anonymous and shared memory with one: the host's OOM killer, or the
    watch as "held the most", took an innocent 300 MB kernel. Now the watch counts all a cgroup is charged but the
    cache of files on disk, or without one ~1 KiB a tmpfs file. In a 900 MB box: an innocent holds 150 MB."""
    report = await in_a_box(900, "inodes", memory_mode)
    attacker, innocent = report["cells"]
    assert not innocent["dead"] and innocent["result"] == "'innocent'", report
    assert attacker["dead"] and attacker["crashed"] and "the most" in attacker["death"], report  # held, or grew


async def test_19_tmpfs_files_count_against_the_sandbox_that_wrote_them(memory_mode):
    """Issue 44, before: six sandboxes filling their tmpfs mounts (376 MB each, within their own limits) beside an
    innocent holding 300 MB: without a cgroup the watch saw only PSS and the host's OOM killer took the innocent, whose
    SIGKILL was scored as its own crash; with one the watch killed the innocent, the largest while the others were
    still filling, "by its own doing". Now the watch counts tmpfs pages, and short of one holding half the share it
    kills the one that grew the most; a SIGKILL while the host's OOM kills rose is not the agent's doing (test 12)."""
    report = await in_a_box(2000, "tmpfs", memory_mode)
    *hogs, innocent = report["cells"]
    assert not innocent["dead"] and innocent["result"] == "'innocent'", report
    deaths = [c for c in hogs if c["dead"]]
    assert deaths and all(c["crashed"] and "while it grew the most" in c["death"] for c in deaths), report


# --------------------------------------------------------------------------- 20. mappings

MAPPINGS = r"""import ctypes, os, time
done = os.pipe()
if os.fork() == 0:  # 60,000 one-page mappings, alternately read-only and writable (none merge), then 60 forks of them
    mmap, c = ctypes.CDLL(None).mmap, ctypes
    mmap.restype, mmap.argtypes = c.c_void_p, [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
    for i in range(60_000):
        mmap(None, 4096, 1 + 2 * (i % 2), 0x22, -1, 0)
    for _ in range(60):
        if os.fork() == 0:
            break
    os.write(done[1], b'.')
    time.sleep(120)
    os._exit(0)
n = 0
while n < 61:
    n += len(os.read(done[0], 64))
time.sleep(5)  # the watch reads it meanwhile"""
PAST_LIMIT = ("import time\ntime.sleep(1)\nx = bytearray(b'1') * (300 << 20)  # its limit is 256 MB\n"
              "print(time.time(), flush=True)\ntime.sleep(9)")


async def killed_how_late(k: Kernel):
    r = await k.execute(PAST_LIMIT)
    return r, time.time() - float(r.stdout or time.time())  # no time printed: killed before it could print


async def test_20_a_sandbox_of_millions_of_mappings_is_killed_for_what_reading_it_costs(tools, monkeypatch):
    """Issue 44, before (no cgroup): reading a sandbox of 10 processes x 60k mappings took 1.5-2.2 s, and the watch
    read every sandbox in turn: every limit was enforced that late. Now each sandbox is read in a thread of its own (a
    slow read delays only its own: tests/test_sandbox.py), and one whose read costs more than cgroup.SLOW s of the
    host's CPU is killed, its own doing: here 61 processes x 60k mappings (~0.6 s a read); another sandbox past its
    limit meanwhile is killed within the watch's period."""
    monkeypatch.setattr(cgroup, "detect", lambda: NO_CGROUP)
    monkeypatch.setattr(cgroup, "shared", lambda: NO_CGROUP)
    mapper = (await started(1, tools, SandboxConfig(max_procs=96), KernelConfig(exec_timeout=60)))[0]
    victim = (await started(1, tools, SandboxConfig(total_memory_mb=256)))[0]
    try:
        async with host_health(tools, "20 61 processes x 60k mappings in one sandbox, another past its limit"):
            made, (past, late) = await asyncio.gather(mapper.execute(MAPPINGS), killed_how_late(victim))
    finally:
        await asyncio.gather(mapper.shutdown(), victim.shutdown())
    print(f"\nMAPPINGS {made.death or made.result}; the other killed {late:.2f} s past its limit")
    assert made.dead and made.crashed and "reading its memory cost the host" in made.death, made.text()
    assert past.dead and past.crashed and past.death == "killed: the sandbox reached its memory limit (256 MB)", past
    assert late < 1.5  # the watch's period (0.25 s), its wait for reads (at most 0.25 s), the kill on a busy host


# --------------------------------------------------------------------------- 21, 22. page and search backends

STAND_IN = r'''import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body=b"", length=None):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # the page reader: GET /<page url>
        if self.path.startswith("/down/"):
            return self.reply(503, b"the reader is down")
        if self.path == "/https://example.com":
            return self.reply(200, b"Example Domain")
        if self.path.startswith("/https://slow."):
            time.sleep(30)
        if self.path.startswith("/https://huge."):  # 100 MB, 64 KiB at a time
            try:
                self.reply(200, b"a" * (64 << 10), length=100 << 20)
                for _ in range(1599):
                    self.wfile.write(b"a" * (64 << 10))
            except OSError:
                pass
            return
        self.reply(422, b'{"code": 422, "message": "Failed to goto: net::ERR_NAME_NOT_RESOLVED"}')

    def do_POST(self):  # serper's /search, a retriever's /retrieve
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        query = body.get("q") or body["queries"][0]
        if self.path.startswith("/down/") or "fail" in query:
            return self.reply(503 if self.path.startswith("/down/") else 400, b"refused")
        hit = {"title": "Capital", "link": "https://example.com", "snippet": "The capital."}
        doc = {"document": {"id": "d1", "contents": '"Capital"\nThe capital.'}, "score": 1.0}
        self.reply(200, json.dumps({"organic": [hit]} if "q" in body else {"result": [[doc]]}).encode())

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_port, flush=True)
server.serve_forever()
'''


@contextlib.asynccontextmanager
async def stand_in():
    """serper.dev, a page reader (Jina's API) and a retriever in a process of their own (the host's memory is the
    tool server's alone); under /down/ all three answer HTTP 503."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", STAND_IN, stdout=asyncio.subprocess.PIPE)
    try:
        yield f"http://127.0.0.1:{int(await asyncio.wait_for(proc.stdout.readline(), 30))}"
    finally:
        proc.kill()
        await proc.wait()


def serper(url: str, timeout: float):
    from l0_min.search import JinaReader, SerperBackend

    return SerperBackend("key", base_url=url, reader=JinaReader(base_url=url, timeout=timeout), timeout=timeout)


async def test_21_pages_of_100_mb_never_grow_the_host(tools):
    """Issue 44, before: search.py read a reply whole, then the tool server kept page_chars of it: 4 episodes reading
    pages of 100 MB grew the host by 364 MB (the bound is 150). Now it reads MAX_REPLY bytes of a reply, no more."""
    async with stand_in() as url:
        backend = serper(url, 20)
        server = ToolServer(backend, timeout=20)
        await server.start()
        kernels = await started(4, server)
        try:
            async with host_health(tools, "21 four episodes reading pages of 100 MB at once"):
                rs = await asyncio.gather(*(k.execute("len(read_page('https://huge.example/page'))") for k in kernels))
        finally:
            await asyncio.gather(*(k.shutdown() for k in kernels))
            await server.close()
            await backend.close()
    assert [r.result for r in rs] == [str(server.page_chars)] * 4, [r.text() for r in rs]


FAILING = """from l0_toolbox.client import ToolError
for tool, arg in [(read_page, 'https://unfetchable.invalid/x'), (read_page, 'https://slow.example/'),
                  (read_page, 'a failing title'), (web_search, 'fail me')]:
    try:
        print(str(tool(arg))[:200])
    except ToolError as e:
        print(str(e)[:200])"""


async def test_22_a_page_or_query_that_fails_is_an_answer_to_the_agent_and_only_a_backend_down_is_masked():
    """Issue 44, before: under tools.search=serper, read_page of a page that cannot be fetched raised in search.py,
    and the tool server recorded a backend failure: the episode was masked as an environment error, the agent's
    choice. Now a failed call is the backend's only if the backend also fails a request no agent chose (tools.PROBE);
    else it is an answer to the agent: under serper and a retriever, the episode is scored. A backend down for every
    call is the environment's: retried, then masked and counted."""
    from l0_min.search import RetrieverClient

    cfg = episode_config()
    cfg.rollout.max_retries = 1
    async with stand_in() as url:
        backends = {"serper": serper(url, 20), "retriever": RetrieverClient(url), "down": serper(f"{url}/down", 20)}
        servers = {name: ToolServer(b, timeout=2) for name, b in backends.items()}
        envs = {}
        try:
            for name, server in servers.items():
                await server.start()
                envs[name] = Services(cfg, None, Kernels(await started(2, server)), server, TOK, {"qa": QA(cfg)})
                envs[name].policy = Script(*[FAILING, "submit_final_answer('a')"] * 2)  # a retry plays them again
            eps = dict(zip(envs, await asyncio.gather(*(run_one(env, Task(n, "q", ["a"])) for n, env in envs.items()))))
        finally:
            await asyncio.gather(*(k.shutdown() for env in envs.values() for k in env.kernels.kernels))
            for name, server in servers.items():
                await server.close()
                await backends[name].close()
    for name in ("serper", "retriever"):
        ep = eps[name]
        assert ep.status == ANSWERED and not ep.masked and envs[name].counters["env_retries"] == 0, (name, ep.error)
        print(f"\n{name}:", ep.steps[0].observation)
    lines = eps["serper"].steps[0].observation.split("<output>\n")[1].splitlines()
    assert lines[0].startswith("read_page: the read_page backend failed: SearchError") and "HTTP 422" in lines[0], lines
    assert lines[1:4] == ["read_page: the read_page backend did not answer within 2 s", "read_page needs a web address "
                          "(http://... or https://...) from web_search results, got 'a failing title'.",
                          "web_search: the web_search backend failed: SearchError: serper: POST " + url + "/search -> "
                          "HTTP 400: refused"], lines  # fmt: skip
    down = eps["down"]
    assert down.status == ENV_ERROR and down.masked and envs["down"].counters["env_retries"] == 1, down.error
    assert "tool backend failure(s), the first: the read_page backend failed: SearchError" in down.error
