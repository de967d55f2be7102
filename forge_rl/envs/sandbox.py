"""Runs model-written Python as untrusted code, in a confined process of its own.

`run_python(code, config)` writes `code` into a fresh temporary directory, starts a child process,
confines it (below), runs the code there as `python -I -S main.py` (standard library only) and
returns its exit status and its output, truncated. Nothing runs in the caller's process.

What it guarantees, on Linux (x86_64 or aarch64) with seccomp and Landlock (kernel >= 5.13 with
Landlock enabled; tested on 6.18, tests/unit/test_envs.py tries each escape):
- One process, one thread: it cannot start another process or thread (fork, vfork, clone, clone3
  are denied, so subprocess, os.system, multiprocessing and threading fail), so no fork bomb.
- Resources (setrlimit in the child): CPU time (`max_cpu_time_s`, then SIGXCPU and SIGKILL),
  address space (`max_memory_bytes`: allocations past it raise MemoryError), size of any file it
  writes (`max_file_bytes`), open files (`max_open_files`), no core dumps.
- Time: past `max_wall_time_s` it is killed (SIGKILL).
- Files (Landlock, which also forbids mount): it reads and writes only its temporary directory
  (also its cwd, HOME and TMPDIR), deleted afterwards, and may not execute files there; elsewhere
  it may only read and execute the Python installation and system libraries (/usr, /lib, /lib64,
  /bin, /etc/ld.so.cache) and use /dev/null, /dev/zero and /dev/urandom. So it cannot read or write
  the run directory, checkpoints, home directories or /proc (no other process's environment).
- Network: none. socket() is denied for every address family (so also Unix sockets to local
  services), and io_uring, which could open sockets around that; where user and network namespaces
  are permitted it also sits in an empty network namespace, and on Landlock >= 4 TCP is denied too.
- Other processes: it cannot signal any (Landlock's signal scope on kernels >= 6.12; elsewhere
  kill, tkill, tgkill, the sigqueue calls and pidfd_send_signal are denied; on every kernel the
  fcntl and ioctl commands that have a file signal a chosen process are denied), trace them, read or
  write their memory (ptrace, process_vm_readv/writev, pidfd_getfd, perf_event_open denied) or use
  the user's key ring.
- Privileges: no_new_privs; where user namespaces are permitted it runs as "nobody" inside one, so
  with no capabilities even when the caller is root. A root caller on a machine without user
  namespaces is refused (root's capabilities, such as loading kernel modules, must not reach
  untrusted code).
- Environment: it starts from a scrubbed environment (PATH, HOME, TMPDIR, LANG only); none of the
  caller's environment variables, open files or memory is passed on.
- If any of these mechanisms is missing on the machine, `run_python` raises SandboxUnavailable
  naming it: it never runs the code with less isolation than stated here.

What it does not guarantee:
- Disk: each file is bounded, not their number: the code can fill the file system of its temporary
  directory until its time runs out.
- Kernel bugs: the isolation is as strong as seccomp, Landlock and namespaces, not a virtual
  machine's. For hostile users at scale, run the executor on machines of its own.
- Programs that need threads or child processes do not run here (see above).
- It shares the CPU with the caller (not niced or pinned), may read the standard library and the
  system libraries, and sees the host's time, hostname and kernel version.

How: the parent starts `python -I -S sandbox.py` with a scrubbed environment, its cwd the temporary
directory, and one extra pipe. That child (the functions under "Child side" below: standard library
only, as forge_rl is not importable there) dies with its parent, enters new user and network
namespaces where permitted, sets no_new_privs and the rlimits, installs the Landlock ruleset and the
seccomp filter, reports on the pipe which mechanisms hold, and replaces itself with `python -I -S
main.py`: all of it survives the exec. Why not RLIMIT_NPROC for the process limit: the kernel
exempts uid 0 from it even inside a user namespace (tested here), so it cannot bind a root caller.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from dataclasses import asdict, dataclass

_MAIN_FILE = "main.py"
"""The code's file in the sandbox directory."""
_UNAVAILABLE_EXIT_CODE = 70
"""The child's exit code when a required mechanism is missing (it then runs nothing)."""
_REPORT_TIMEOUT_S = 30.0
"""How long the child may take to confine itself before the parent gives up (a busy host)."""
_OUTPUT_DRAIN_TIMEOUT_S = 5.0
"""How long after the kill the output pipes may take to close. Only a process that survived SIGKILL
could hold them open longer, and that is reported as an error rather than waited for."""


@dataclass(frozen=True)
class SandboxConfig:
    """The limits of one run of untrusted code."""

    max_wall_time_s: float = 10.0
    """Wall-clock seconds from its start to its kill (SIGKILL)."""
    max_cpu_time_s: int = 5
    """CPU seconds (RLIMIT_CPU): SIGXCPU at this, SIGKILL one second later."""
    max_memory_bytes: int = 512 * 2**20
    """Address space (RLIMIT_AS); allocations past it fail (MemoryError)."""
    max_file_bytes: int = 16 * 2**20
    """Largest file it may write (RLIMIT_FSIZE); a write past it fails."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_output_bytes: int = 16 * 2**10
    """Bytes kept of stdout and of stderr each; the rest is read and dropped (output_truncated)."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"SandboxConfig.{name} ({value}) must be > 0: a limit of 0 would refuse every run.")

    @property
    def max_run_s(self) -> float:
        """The longest one `run_python` can legitimately take, start-up included = the child's time
        to confine itself (_REPORT_TIMEOUT_S, 30 s) + max_wall_time_s + the output drain after a
        kill (_OUTPUT_DRAIN_TIMEOUT_S, 5 s). A caller that times it out sooner kills a sandbox mid-run."""
        return _REPORT_TIMEOUT_S + self.max_wall_time_s + _OUTPUT_DRAIN_TIMEOUT_S


@dataclass(frozen=True)
class SandboxResult:
    """What the code did: its exit, its output, and which mechanisms confined it."""

    exit_code: int
    """The process's exit status; negative when a signal killed it (-9: SIGKILL), as subprocess reports."""
    stdout: str
    stderr: str
    timed_out: bool
    """Killed at max_wall_time_s."""
    output_truncated: bool
    """stdout or stderr was longer than max_output_bytes and was cut there."""
    isolation: tuple[str, ...]
    """The mechanisms that confined it, as the child reported them (e.g. "landlock", "seccomp")."""

    @property
    def ended_by(self) -> str:
        """How it ended, in words a model can read: "exit code 0", "killed: CPU time limit", ..."""
        if self.timed_out:
            return "killed: wall-clock time limit"
        if self.exit_code >= 0:
            return f"exit code {self.exit_code}"
        import signal

        if -self.exit_code == signal.SIGXCPU:
            return "killed: CPU time limit"
        return f"killed by {signal.Signals(-self.exit_code).name}"


# ---------------------------------------------------------------------------------------------------
# Parent side: runs in the caller's process.
# ---------------------------------------------------------------------------------------------------


async def run_python(code: str, config: SandboxConfig) -> SandboxResult:
    """Run `code` as `python main.py` in a fresh sandbox; never raises for anything the code does.

    Raises SandboxUnavailable when this machine cannot confine it as the module docstring states.
    """
    import shutil
    import tempfile

    sandbox_dir = tempfile.mkdtemp(prefix="forge-sandbox-")
    try:
        with open(os.path.join(sandbox_dir, _MAIN_FILE), "w") as main_file:
            main_file.write(code)
        return await _run_confined(sandbox_dir, config)
    finally:
        shutil.rmtree(sandbox_dir, ignore_errors=True)


async def _run_confined(sandbox_dir: str, config: SandboxConfig) -> SandboxResult:
    import subprocess

    interpreter = os.path.realpath(sys.executable)  # not a venv's link: the child reads no venv files
    report_read, report_write = os.pipe()
    process = subprocess.Popen(
        [interpreter, "-I", "-S", os.path.abspath(__file__),
         str(os.getpid()), str(report_write), json.dumps(asdict(config))],
        cwd=sandbox_dir,
        env={"PATH": "/usr/bin:/bin", "HOME": sandbox_dir, "TMPDIR": sandbox_dir, "LANG": "C.UTF-8"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(report_write,),
    )
    os.close(report_write)
    try:
        return await _supervise(process, os.fdopen(report_read, "rb"), config)
    finally:
        # SIGKILL by pid is safe from pid reuse: the child is not reaped until the wait below.
        process.kill()
        process.wait()


async def _supervise(process, report_pipe, config: SandboxConfig) -> SandboxResult:
    """Read the child's report, wait for the code to exit or its time to run out, kill it, and
    collect the output."""
    import asyncio

    stdout = asyncio.ensure_future(_read_capped(process.stdout, config.max_output_bytes))
    stderr = asyncio.ensure_future(_read_capped(process.stderr, config.max_output_bytes))
    try:
        report = json.loads((await _read_capped(report_pipe, 65536, _REPORT_TIMEOUT_S))[0] or b"{}")
        timed_out = "error" not in report and not await _exits_within(process.pid, config.max_wall_time_s)
        process.kill()
        (stdout_bytes, stdout_cut), (stderr_bytes, stderr_cut) = await asyncio.wait_for(
            asyncio.gather(stdout, stderr), _OUTPUT_DRAIN_TIMEOUT_S
        )
    except asyncio.TimeoutError:
        raise RuntimeError(
            f"sandbox process {process.pid}: no confinement report within {_REPORT_TIMEOUT_S} s, or its "
            f"output still open {_OUTPUT_DRAIN_TIMEOUT_S} s after SIGKILL."
        ) from None
    finally:
        stdout.cancel()
        stderr.cancel()
    if "error" in report:  # a mechanism this machine lacks: the child said which
        from forge_rl.errors import SandboxUnavailable  # here: forge_rl is not importable in the child

        raise SandboxUnavailable(f"{report['error']} {stderr_bytes.decode(errors='replace')}".strip())
    if "isolation" not in report:  # the child crashed before confining itself: a defect, never a skip
        raise RuntimeError(
            f"sandbox process {process.pid} exited before reporting its confinement: "
            f"{stderr_bytes.decode(errors='replace').strip()}"
        )
    return SandboxResult(
        exit_code=process.wait(),
        stdout=stdout_bytes.decode(errors="replace"),
        stderr=stderr_bytes.decode(errors="replace"),
        timed_out=timed_out,
        output_truncated=stdout_cut or stderr_cut,
        isolation=tuple(report["isolation"]),
    )


async def _exits_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` (a child not yet reaped) exits within `timeout_s`: its pidfd turns
    readable when it exits."""
    import asyncio

    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _read_capped(pipe, max_bytes: int, timeout_s: float | None = None) -> tuple[bytes, bool]:
    """Everything `pipe` gives up to EOF, keeping the first `max_bytes` (reading on, so the writer
    never blocks), and whether anything was dropped. TimeoutError past `timeout_s`."""
    import asyncio

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    kept, truncated = bytearray(), False

    async def read_all() -> None:
        nonlocal kept, truncated
        while chunk := await reader.read(65536):
            room = max_bytes - len(kept)
            kept += chunk[:room]
            truncated |= len(chunk) > room

    try:
        await asyncio.wait_for(read_all(), timeout_s)
    finally:
        transport.close()
    return bytes(kept), truncated


# ---------------------------------------------------------------------------------------------------
# Child side: runs as `python -I -S sandbox.py PARENT_PID REPORT_FD CONFIG_JSON`, before the code. Standard
# library only, and nothing that could block: the parent waits for the report.
# ---------------------------------------------------------------------------------------------------

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


class _Missing(Exception):
    """A required mechanism is unavailable; the message says which, why and what to do."""


def _child_main(parent_pid: int, report_fd: int, config: SandboxConfig) -> None:
    try:
        isolation = _confine(parent_pid, config)
    except _Missing as missing:
        _report(report_fd, {"error": str(missing)})
        os._exit(_UNAVAILABLE_EXIT_CODE)
    _report(report_fd, {"isolation": isolation})
    os.execv(sys.executable, [sys.executable, "-I", "-S", _MAIN_FILE])


def _report(report_fd: int, message: dict) -> None:
    os.write(report_fd, json.dumps(message).encode())
    os.close(report_fd)


def _confine(parent_pid: int, config: SandboxConfig) -> list[str]:
    """Apply every mechanism, in the order they need (namespaces before /proc becomes unreadable,
    no_new_privs before Landlock and seccomp); the names of those applied."""
    if not sys.platform.startswith("linux"):
        raise _Missing(f"untrusted code runs only on Linux (this is {sys.platform}): it needs seccomp and Landlock.")
    _die_with_parent(parent_pid)
    isolation = _enter_namespaces()
    if "user namespace" not in isolation and os.geteuid() == 0:
        raise _Missing(
            "this runs as root and user namespaces are not permitted here, so the code would keep "
            "root's capabilities (loading kernel modules, for one). Allow unprivileged user namespaces "
            "(sysctl user.max_user_namespaces > 0; in Docker, a seccomp profile that permits unshare) "
            "or run as an unprivileged user."
        )
    _check_prctl(_libc().prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    _set_rlimits(config)
    isolation.append("rlimits")
    landlock_abi = _apply_landlock()
    isolation.append("landlock" if landlock_abi < 6 else "landlock+signal scope")
    _apply_seccomp(deny_signals=landlock_abi < 6)
    isolation.append("seccomp")
    return isolation


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it exits (the caller's event loop thread:
    run_python from a short-lived thread would kill its sandbox early), so none outlives the run."""
    import signal

    _check_prctl(_libc().prctl(1, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _check_prctl(result: int, what: str) -> None:
    if result != 0:
        raise _Missing(f"prctl({what}) failed: {os.strerror(ctypes.get_errno())}.")


_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_NOBODY = 65534


def _enter_namespaces() -> list[str]:
    """New user and network namespaces if permitted, else a user namespace alone, else none; the
    code runs as "nobody" inside, so with no capabilities at all once it is exec'd."""
    uid, gid = os.getuid(), os.getgid()
    for flags, names in (
        (_CLONE_NEWUSER | _CLONE_NEWNET, ["user namespace", "network namespace"]),
        (_CLONE_NEWUSER, ["user namespace"]),
    ):
        if _libc().unshare(flags) == 0:
            break
    else:
        return []
    # The only mapping an unprivileged process may write: its own uid and gid, once each.
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{_NOBODY} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{_NOBODY} {gid} 1")
    return names


def _set_rlimits(config: SandboxConfig) -> None:
    import resource

    limits = {
        resource.RLIMIT_CPU: (config.max_cpu_time_s, config.max_cpu_time_s + 1),  # SIGXCPU, then SIGKILL
        resource.RLIMIT_AS: (config.max_memory_bytes,) * 2,
        resource.RLIMIT_FSIZE: (config.max_file_bytes,) * 2,
        resource.RLIMIT_NOFILE: (config.max_open_files,) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for limit, values in limits.items():
        resource.setrlimit(limit, values)


# Landlock (linux/landlock.h). Access rights on files and directories:
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_FILE_RIGHTS_V1 = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE
_FS_ALL_V1 = (1 << 13) - 1  # execute ... make_sym
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every arch
_READ_ONLY_PATHS = ("/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")


def _apply_landlock() -> int:
    """Restrict the file system to the sandbox directory (everything), the Python installation and
    system libraries (read, execute) and a few devices; deny TCP and signals out of the sandbox
    where the kernel's Landlock version can. Returns that version (its ABI)."""
    syscall = _libc().syscall
    syscall.restype = ctypes.c_long
    abi = syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        raise _Missing(
            f"Landlock is unavailable ({os.strerror(ctypes.get_errno())}): the sandbox cannot confine "
            "file access. It needs Linux >= 5.13 with Landlock enabled (CONFIG_SECURITY_LANDLOCK, "
            "'landlock' in the lsm= boot parameter)."
        )
    handled_fs = _FS_ALL_V1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    handled_fs |= _FS_IOCTL_DEV if abi >= 5 else 0
    handled_net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0  # with no rule: all TCP denied
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", handled_fs, handled_net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = syscall(_SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _Missing(f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}.")
    read_execute = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    rules = [(path, read_execute) for path in (*_READ_ONLY_PATHS, sys.base_prefix, sys.prefix)]
    rules += [(path, _FS_READ_FILE | _FS_WRITE_FILE) for path in _DEVICES]
    rules.append((os.getcwd(), handled_fs & ~_FS_EXECUTE))  # the sandbox directory: all but running files
    for path, access in rules:
        _add_landlock_rule(ruleset, path, access & handled_fs)
    if syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
        raise _Missing(f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}.")
    os.close(ruleset)
    return abi


def _add_landlock_rule(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:  # e.g. no /lib64 on this distribution
        return
    try:
        if not os.path.isdir(path):
            access &= _FS_FILE_RIGHTS_V1 | _FS_TRUNCATE | _FS_IOCTL_DEV  # rights a file can carry
        rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr (packed)
        if _libc().syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, ctypes.c_int(1), rule, ctypes.c_uint32(0)) != 0:
            raise _Missing(f"landlock_add_rule({path}) failed: {os.strerror(ctypes.get_errno())}.")
    finally:
        os.close(fd)


# seccomp: (audit arch, {system call: number}) per machine, numbers from the kernel's unistd headers.
# aarch64 has no fork or vfork call (glibc forks with clone).
_SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, {
        "fork": 57, "vfork": 58, "clone": 56, "clone3": 435,
        "socket": 41, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
        "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
        "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
        "pidfd_send_signal": 424, "fcntl": 72, "ioctl": 16,
    }),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435,
        "socket": 198, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
        "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
        "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
        "pidfd_send_signal": 424, "fcntl": 25, "ioctl": 29,
    }),
}
_SIGNAL_SYSCALLS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal")
_SIGIO_OWNER_COMMANDS = {"fcntl": (8, 15, 10), "ioctl": (0x8901, 0x8902)}
"""F_SETOWN, F_SETOWN_EX, F_SETSIG; FIOSETOWN, SIOCSPGRP: they make the kernel signal a process of
the code's choosing when a file is ready (SIGIO, or any signal), which kill's denial would miss."""
_X32_SYSCALL_BIT = 0x40000000


def _apply_seccomp(deny_signals: bool) -> None:
    """A classic-BPF filter: another architecture's calling convention kills the process (so i386
    socketcall cannot go around the table), the denied calls fail with EPERM, the rest pass."""
    import errno
    import platform

    machine = platform.machine()
    if machine not in _SECCOMP_ARCHES:
        raise _Missing(f"the sandbox's seccomp filter knows x86_64 and aarch64 system calls, not {machine}.")
    audit_arch, numbers = _SECCOMP_ARCHES[machine]
    denied = [
        number for name, number in numbers.items()
        if name not in _SIGIO_OWNER_COMMANDS and (deny_signals or name not in _SIGNAL_SYSCALLS)
    ]
    load, jump_eq, jump_ge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, RET|K
    kill_process, allow, deny = 0x80000000, 0x7FFF0000, 0x00050000 | errno.EPERM
    nr, arch, command = 0, 4, 24  # offsets in struct seccomp_data; command: low half of args[1]
    # (code, k, jump target if true, if false); a string is a label, targets name labels.
    program: list = [
        (load, arch, None, None),
        (jump_eq, audit_arch, "native", None),
        (ret, kill_process, None, None),
        "native",
        (load, nr, None, None),
        (jump_ge, _X32_SYSCALL_BIT, "deny", None),  # x32 calls on x86_64
        *[(jump_eq, numbers[name], name, None) for name in _SIGIO_OWNER_COMMANDS],
        *[(jump_eq, number, "deny", None) for number in denied],
        (ret, allow, None, None),
    ]
    for name, commands in _SIGIO_OWNER_COMMANDS.items():
        program += [name, (load, command, None, None)]
        program += [(jump_eq, command, "deny", None) for command in commands] + [(ret, allow, None, None)]
    program += ["deny", (ret, deny, None, None)]
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in _assemble(program)))
    fprog = struct.pack("=HxxxxxxQ", len(filters) // 8, ctypes.addressof(filters))  # struct sock_fprog
    _check_prctl(_libc().prctl(22, 2, ctypes.c_char_p(fprog), 0, 0), "PR_SET_SECCOMP")  # 2: MODE_FILTER


def _assemble(program: list) -> list[tuple[int, int, int, int]]:
    """Classic BPF (code, jt, jf, k) from instructions whose jumps name labels: a jump's offset is
    the number of instructions it skips, forward only."""
    labels, instructions = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(instructions)
        else:
            instructions.append(item)

    def offset(index: int, label: str | None) -> int:
        return 0 if label is None else labels[label] - index - 1

    return [
        (code, offset(i, if_true), offset(i, if_false), k) for i, (code, k, if_true, if_false) in enumerate(instructions)
    ]


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]), SandboxConfig(**json.loads(sys.argv[3])))
