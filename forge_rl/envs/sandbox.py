"""Runs model-written Python as untrusted code, in a confined process of its own.

`run_python(code, config)` writes `code` into a fresh temporary directory, starts a child process,
confines it (below), runs the code there as `python -I -S main.py` (standard library only) and
returns its exit status and its output, truncated. Nothing runs in the caller's process.

What it guarantees, on Linux with seccomp (through libseccomp) and Landlock (kernel >= 5.13 with
Landlock enabled; the tests of the sandbox try each escape for real):
- System calls: an allow list (deny by default, EPERM) of what CPython needs to run the standard
  library in one thread: files, its own memory, time, its own signal handlers, reading (not
  changing) its own scheduling. Everything else fails, including nested namespaces (unshare, setns),
  the mount API, bpf, userfaultfd, pidfd_open, kcmp, memfd_create and System V shared memory, page
  migration, process_madvise, and changing any process's priority, affinity, scheduler or I/O class.
  A call through another architecture's convention (i386, x32) kills the process.
- One process, one thread: it cannot start another process or thread (fork, vfork, clone, clone3
  are denied, so subprocess, os.system, multiprocessing and threading fail), so no fork bomb.
- Resources (setrlimit in the child): CPU time (`max_cpu_time_s`, then SIGXCPU and SIGKILL),
  address space (`max_memory_bytes`: allocations past it raise MemoryError), size of any file it
  writes (`max_file_bytes`), open files (`max_open_files`), no core dumps. prlimit64 is allowed on
  itself only: the kernel lets a process change the limits of any process of its real uid, which
  the user namespace keeps, so elsewhere it could kill the caller by its RLIMIT_CPU.
- Disk: where a mount namespace is permitted, its directory is a tmpfs of `max_disk_bytes` (host
  memory, which RLIMIT_AS does not bound), so what it writes in all is capped; where it is not, the
  code may create no file at all (only rewrite its main.py, up to `max_file_bytes`).
- Time: past `max_wall_time_s` it is killed (SIGKILL).
- Files (Landlock, which also forbids mount): it reads and writes only its temporary directory
  (also its cwd, HOME and TMPDIR), deleted afterwards, and may not execute files there; elsewhere
  it may only read and execute the Python installation and system libraries (/usr, /lib, /lib64,
  /bin, /etc/ld.so.cache) and use /dev/null, /dev/zero and /dev/urandom. So it cannot read or write
  the run directory, checkpoints, home directories or /proc (no other process's environment).
- Network: none. socket() is denied for every address family (so also Unix sockets to local
  services), and io_uring, which could open sockets around that; where user and network namespaces
  are permitted it also sits in an empty network namespace, and on Landlock >= 4 TCP is denied too.
- Other processes: it cannot signal any (the kill family is allowed with its own pid only, and
  Landlock's signal scope adds the same on kernels >= 6.12; only the fcntl and ioctl commands of an
  allow list pass, none of those that have a file signal a chosen process), trace them, read or
  write their memory (ptrace, process_vm_readv/writev, pidfd_getfd, perf_event_open) or use the
  user's key ring.
- Privileges: no_new_privs; where user namespaces are permitted it runs as "nobody" inside one, so
  with no capabilities even when the caller is root.
- The Python installation it reads: `run_python` refuses one (sys.prefix or sys.base_prefix) that
  is `/` or holds a home directory or the caller's working directory (where `runs/` is written). A root caller on a machine without user
  namespaces is refused (root's capabilities, such as loading kernel modules, must not reach
  untrusted code).
- Environment: it starts from a scrubbed environment (PATH, HOME, TMPDIR, LANG only); none of the
  caller's environment variables, open files or memory is passed on.
- If any of these mechanisms is missing on the machine, `run_python` raises SandboxUnavailable
  naming it: it never runs the code with less isolation than stated here.

What it does not guarantee:
- Kernel bugs: the isolation is as strong as seccomp, Landlock and namespaces, not a virtual
  machine's. For hostile users at scale, run the executor on machines of its own.
- Programs that need threads or child processes do not run here (see above).
- It shares the CPU with the caller (not niced or pinned), may read the standard library and the
  system libraries, and sees the host's time, hostname and kernel version.

How: the parent starts `python -I -S sandbox.py` with a scrubbed environment, its cwd the temporary
directory, and one extra pipe. That child (the functions under "Child side" below: standard library
only, as forge_rl is not importable there) dies with its parent, enters new user, mount and
network namespaces where permitted, mounts its size-capped tmpfs, sets no_new_privs and the
rlimits, installs the Landlock ruleset and the seccomp filter (libseccomp through ctypes), reports on the pipe which mechanisms hold, and replaces itself with `python -I -S
main.py`: all of it survives the exec. Why not RLIMIT_NPROC for the process limit: the kernel
exempts uid 0 from it even inside a user namespace, so it cannot bind a root caller.
"""

from __future__ import annotations

import ctypes
import functools
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
_FIRST_LOGIN_UID = 1000
"""Below it (but root), accounts are the system's (login.defs' UID_MIN), whose homes are /bin, /var/www, ..."""
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
    max_disk_bytes: int = 32 * 2**20
    """Bytes its directory may hold in all, its code included: the directory is a tmpfs of this size
    (host memory, which RLIMIT_AS does not bound), so a write past it fails with ENOSPC."""
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

    _check_installation_is_not_private()
    interpreter = os.path.realpath(sys.executable)  # not a venv's link: the child reads no venv files
    report_read, report_write = os.pipe()
    process = subprocess.Popen(
        [
            interpreter,
            "-I",
            "-S",
            os.path.abspath(__file__),
            str(os.getpid()),
            str(report_write),
            json.dumps(asdict(config)),
        ],
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


def _check_installation_is_not_private() -> None:
    """The sandboxed code may read all of the Python installation (sys.prefix, sys.base_prefix):
    refuse one that is the root or holds a home directory or this process's working directory
    (where runs, checkpoints and their weights are written, `runs/` by default)."""
    from forge_rl.errors import SandboxUnavailable

    private = {os.path.realpath(os.path.expanduser("~")), os.path.realpath(os.getcwd())} | _login_homes()
    for prefix in sorted({sys.prefix, sys.base_prefix}):
        real = os.path.realpath(prefix)
        held = sorted(path for path in private if real == "/" or path == real or path.startswith(real + os.sep))
        if held:
            raise SandboxUnavailable(
                f"the Python installation {prefix} (sys.prefix or sys.base_prefix) holds {held[0]}, a home "
                "directory or this process's working directory, and sandboxed code may read all of the "
                "installation: it would read what the sandbox exists to hide. Run forge_rl from a Python "
                "installed or a virtual environment created elsewhere (for example /opt/venv)."
            )


@functools.cache
def _login_homes() -> frozenset[str]:
    """People's homes: root's and those of login users, not system accounts' (/bin, /var/www, ...).
    Read once per process: every sandbox run asks, and the user database can be remote (NSS)."""
    import pwd

    return frozenset(
        os.path.realpath(user.pw_dir)
        for user in pwd.getpwall()
        if (user.pw_uid == 0 or _FIRST_LOGIN_UID <= user.pw_uid < _NOBODY) and user.pw_dir not in ("", "/")
    )


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
    loop.add_reader(pidfd, lambda: None if exited.done() else exited.set_result(None))
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
    if "mount namespace" in isolation:
        _mount_capped_directory(config)
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
    landlock_abi = _apply_landlock(capped_directory="mount namespace" in isolation)
    isolation.append("landlock" if landlock_abi < 6 else "landlock+signal scope")
    _apply_seccomp()
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
_CLONE_NEWNS = 0x00020000
_NOBODY = 65534


def _enter_namespaces() -> list[str]:
    """New user, mount and network namespaces if permitted, else user and mount namespaces alone,
    else none; the code runs as "nobody" inside, so with no capabilities at all once it is exec'd."""
    uid, gid = os.getuid(), os.getgid()
    for flags, names in (  # noqa: B007 (the namespaces of the flags the loop stops at are returned)
        (_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET, ["user namespace", "mount namespace", "network namespace"]),
        (_CLONE_NEWUSER | _CLONE_NEWNS, ["user namespace", "mount namespace"]),
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


_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MAX_INODES = 1024
"""Files and directories the capped directory may hold: each costs kernel memory beyond its bytes."""


def _mount_capped_directory(config: SandboxConfig) -> None:
    """Put a tmpfs of `max_disk_bytes` over the sandbox directory, in this process's own mount
    namespace (invisible to the caller, gone with the process), and the code back into it."""
    directory = os.getcwd()
    with open(_MAIN_FILE, "rb") as main_file:
        code = main_file.read()
    options = f"size={config.max_disk_bytes},nr_inodes={_MAX_INODES},mode=0700"
    mounted = _libc().mount(
        b"tmpfs", directory.encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC), options.encode()
    )
    if mounted != 0:
        raise _Missing(f"mounting the sandbox's size-capped tmpfs failed: {os.strerror(ctypes.get_errno())}.")
    os.chdir(directory)  # the cwd still named the directory under the mount
    with open(_MAIN_FILE, "wb") as main_file:
        main_file.write(code)


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
_FS_MAKE_ANY = ((1 << 13) - 1) & ~(
    (1 << 6) - 1
)  # make_char, make_dir, make_reg, make_sock, make_fifo, make_block, make_sym
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every arch
_READ_ONLY_PATHS = ("/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")


def _apply_landlock(capped_directory: bool) -> int:
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
    # The sandbox directory: all but running files; where it is not a size-capped tmpfs (no mount
    # namespace), no creating files either, so what it holds stays bounded by max_file_bytes.
    directory_access = handled_fs & ~_FS_EXECUTE
    if not capped_directory:
        directory_access &= ~_FS_MAKE_ANY
    rules.append((os.getcwd(), directory_access))
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


# seccomp, through libseccomp (ctypes: the child runs before site-packages exist, see the module
# docstring). An allow list: every system call not named here fails with EPERM, so a call added to the
# kernel tomorrow is denied until someone decides otherwise. Names a machine lacks are skipped
# (arch_prctl exists only on x86_64; aarch64 has no open, stat or fork); another architecture's calling
# convention (i386 and x32 on x86_64) kills the process, so its table cannot go around this one.
_ALLOWED_SYSCALLS = (
    # Files, always within what Landlock grants: the sandbox directory, read-only system paths.
    "read",
    "write",
    "readv",
    "writev",
    "pread64",
    "pwrite64",
    "preadv",
    "pwritev",
    "preadv2",
    "pwritev2",
    "open",
    "openat",
    "openat2",
    "creat",
    "close",
    "close_range",
    "dup",
    "dup2",
    "dup3",
    "lseek",
    "stat",
    "fstat",
    "lstat",
    "newfstatat",
    "statx",
    "statfs",
    "fstatfs",
    "access",
    "faccessat",
    "faccessat2",
    "readlink",
    "readlinkat",
    "getdents",
    "getdents64",
    "getcwd",
    "chdir",
    "fchdir",
    "mkdir",
    "mkdirat",
    "rmdir",
    "unlink",
    "unlinkat",
    "rename",
    "renameat",
    "renameat2",
    "link",
    "linkat",
    "symlink",
    "symlinkat",
    "chmod",
    "fchmod",
    "fchmodat",
    "umask",
    "truncate",
    "ftruncate",
    "fsync",
    "fdatasync",
    "flock",
    "fadvise64",
    "fallocate",
    "utime",
    "utimes",
    "utimensat",
    "futimesat",
    "sendfile",
    "copy_file_range",
    "splice",
    "tee",
    "getxattr",
    "lgetxattr",
    "fgetxattr",
    "listxattr",
    "llistxattr",
    "flistxattr",
    "pipe",
    "pipe2",
    "select",
    "pselect6",
    "poll",
    "ppoll",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_wait",
    "epoll_pwait",
    "epoll_pwait2",
    "eventfd",
    "eventfd2",
    # Memory of its own address space (RLIMIT_AS bounds it).
    "brk",
    "mmap",
    "munmap",
    "mprotect",
    "mremap",
    "madvise",
    "mincore",
    "msync",
    # What a process reads of itself; scheduling it may read, not change.
    "getpid",
    "getppid",
    "gettid",
    "getuid",
    "geteuid",
    "getgid",
    "getegid",
    "getresuid",
    "getresgid",
    "getgroups",
    "getpgrp",
    "getpgid",
    "getsid",
    "uname",
    "sysinfo",
    "times",
    "getrusage",
    "getrlimit",
    "getcpu",
    "getpriority",
    "sched_getaffinity",
    "sched_getparam",
    "sched_getscheduler",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_yield",
    # Time.
    "clock_gettime",
    "clock_getres",
    "clock_nanosleep",
    "nanosleep",
    "gettimeofday",
    "time",
    "getitimer",
    "setitimer",
    "alarm",
    # Its own signal handling (sending signals: _ALLOWED_IF below).
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "rt_sigpending",
    "rt_sigtimedwait",
    "rt_sigsuspend",
    "sigaltstack",
    "pause",
    "restart_syscall",
    # The C runtime of one thread: locks, thread-local storage, restartable sequences, randomness.
    "futex",
    "set_tid_address",
    "set_robust_list",
    "get_robust_list",
    "rseq",
    "arch_prctl",
    "getrandom",
    # Replacing itself (the sandbox's own last step, then any program Landlock lets it execute: it keeps
    # every confinement) and exiting.
    "execve",
    "exit",
    "exit_group",
)
_SELF = "self"
"""Stands for the sandboxed process's pid in _ALLOWED_IF (the same pid before and after its exec)."""
_FCNTL_COMMANDS = (0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 16, 36, 37, 38, 1030, 1031, 1032, 1033, 1034)
"""F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, the record locks, F_GETOWN, F_GETSIG, F_GETOWN_EX,
the open-file-description locks, F_DUPFD_CLOEXEC, the pipe sizes and the seals. Not F_SETOWN,
F_SETOWN_EX, F_SETSIG or F_NOTIFY, which make the kernel signal a process of the code's choosing, nor
F_SETLEASE."""
_IOCTL_COMMANDS = (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451)
"""TCGETS (isatty), TIOCGWINSZ, FIONREAD, FIONBIO, FIONCLEX and FIOCLEX (os.set_inheritable). Not
FIOSETOWN or SIOCSPGRP (a signal to a chosen process when a file is ready), nor anything of devices."""
_ALLOWED_IF: dict[str, list[tuple[int, int | str]]] = {
    # Its own resource limits only: the kernel lets a process change those of any process of the same
    # real uid, which the user namespace keeps (lowering the rollouts' process's RLIMIT_CPU kills it).
    "prlimit64": [(0, 0), (0, _SELF)],
    # Signals to itself only: its process group holds the caller.
    "kill": [(0, _SELF)],
    "tkill": [(0, _SELF)],
    "tgkill": [(0, _SELF)],
    "rt_sigqueueinfo": [(0, _SELF)],
    "rt_tgsigqueueinfo": [(0, _SELF)],
    "fcntl": [(1, command) for command in _FCNTL_COMMANDS],
    "ioctl": [(1, command) for command in _IOCTL_COMMANDS],
}
"""System calls allowed when one argument (by index) has one of the listed values."""


class _ArgCompare(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


_SCMP_ACT_ALLOW, _SCMP_ACT_KILL_PROCESS, _SCMP_ACT_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_SCMP_CMP_MASKED_EQ = 7
_SCMP_FLTATR_ACT_BADARCH = 2
_LOW_32_BITS = 0xFFFFFFFF
"""pids and ioctl/fcntl commands are 32-bit arguments: the kernel reads the register's low half."""


def _apply_seccomp() -> None:
    """Load the allow list (above) as this process's seccomp filter; it survives the exec."""
    import errno

    try:
        seccomp = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as missing:
        raise _Missing(
            f"libseccomp is not installed ({missing}): the sandbox builds its system-call filter with it. "
            "Install it (Debian and Ubuntu: apt install libseccomp2; Fedora: dnf install libseccomp)."
        ) from None
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCompare),
    ]
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
    seccomp.seccomp_release.argtypes = [ctypes.c_void_p]
    context = seccomp.seccomp_init(_SCMP_ACT_ERRNO | errno.EPERM)
    if not context:
        raise _Missing("seccomp_init failed: the kernel or libseccomp cannot build a filter here.")
    try:
        _check_seccomp(seccomp.seccomp_attr_set(context, _SCMP_FLTATR_ACT_BADARCH, _SCMP_ACT_KILL_PROCESS), "attr_set")
        for name in (*_ALLOWED_SYSCALLS, *_ALLOWED_IF):
            number = seccomp.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a system call of this machine
                continue
            for condition in _ALLOWED_IF.get(name, [None]):
                compare = None
                if condition is not None:
                    arg_index, value = condition
                    value = os.getpid() if value == _SELF else value
                    compare = _ArgCompare(arg_index, _SCMP_CMP_MASKED_EQ, _LOW_32_BITS, value)
                rule = seccomp.seccomp_rule_add_array(
                    context,
                    _SCMP_ACT_ALLOW,
                    number,
                    int(compare is not None),
                    ctypes.byref(compare) if compare else None,
                )
                _check_seccomp(rule, f"rule_add({name})")
        _check_seccomp(seccomp.seccomp_load(context), "load")
    finally:
        seccomp.seccomp_release(context)


def _check_seccomp(result: int, what: str) -> None:
    if result != 0:
        raise _Missing(f"seccomp_{what} failed: {os.strerror(-result)}.")


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]), SandboxConfig(**json.loads(sys.argv[3])))
