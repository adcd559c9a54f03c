"""Run a dpops module in a child process that cannot read the noise key or the private inputs.

Used for Great Expectations team suites (``dpops.gx_project``): even an allow-listed suite is
evaluated by a large third-party library, so it runs where a bug or a missed case cannot reach
what the publishing process holds (issue 19 item 5). The child:

* starts from ``sys.executable -I`` (no ``PYTHON*`` variables, no user site) with an environment
  built from scratch: no ``DPOPS_*`` variable, no key reference, no ledger URL, no credentials;
* inherits no file descriptor but its three pipes (``close_fds``), in its own session, with its
  working directory, ``HOME`` and ``TMPDIR`` in a fresh scratch directory and umask 077;
* before it imports anything but this module, confines itself with **Landlock** (Linux >= 5.13,
  unprivileged, and binding even for root): it may read and execute only the Python installation
  (``sys.prefix``, ``sys.base_prefix``, the ``sys.path`` entries that are site or stdlib
  directories), the ``dpops`` package directory and the system library directories (``/usr``,
  ``/lib``, ``/lib64``, ``/etc/ld.so.cache``, ``/etc/localtime``, ``/etc/mime.types``); it may write only its scratch
  directory; it may not bind or connect TCP sockets (ABI >= 4) nor signal or reach abstract sockets
  outside its domain (ABI >= 6). The key file, the data roots, the state and staging directories and
  the ledger are outside that list whatever their modes or owner.
* before Landlock, it cuts itself off the network by construction (:func:`isolate_network`, issue 25
  item 11: Landlock mediates only TCP, and a child reached UDP and the ledger's PostgreSQL Unix socket):
  a **new network namespace** (``unshare(CLONE_NEWNET)``; ``CLONE_NEWUSER`` with it when the child is
  not root), which has no interface but a loopback that is down, so no AF_INET/AF_INET6 socket of any
  type reaches anything, and abstract Unix sockets (which belong to a network namespace) are those of
  the empty namespace; and a **seccomp filter** that lets ``socket()`` create only AF_INET and AF_INET6
  sockets (AF_UNIX, whose pathname sockets live in the filesystem and are not in the namespace,
  AF_NETLINK, AF_PACKET, AF_VSOCK and every other family fail with EACCES) and refuses ``io_uring_setup``
  (which could open sockets without ``socket()``) and any other syscall ABI (x32, i386).
  ``socketpair()`` stays allowed: it connects the process only to itself. If either step fails the
  child exits at once (code 97) with the reason, and :func:`network_isolation_available` lets callers
  refuse before anything is reserved; nothing falls back to an unconfined network.
* when the parent is root and the Python installation is readable by others, it also runs as the
  unprivileged uid/gid 65534 (``nobody``) with no supplementary groups.

Landlock is the boundary that matters: a dropped uid alone still reads world-readable inputs. If
the kernel offers no Landlock, :func:`landlock_abi` returns 0 and callers refuse to run untrusted
suites (``dpops.gx_project``); nothing here falls back silently.

The child receives its job on stdin (JSON) and files in its scratch directory, and answers with one
JSON document on its original stdout; everything it prints goes to stderr, which the parent shows
only under ``DPOPS_DEBUG`` (it may quote published values, never secrets: it cannot read them).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import signal
import stat
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dpops.errors import DEBUG_ENV, InternalError

UNPRIVILEGED_UID = 65534

# Landlock UAPI (include/uapi/linux/landlock.h); the syscall numbers are shared by x86_64 and arm64.
_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446), "arm64": (444, 445, 446)}
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 14, 1 << 15
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_READ_RIGHTS = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

# Network isolation (isolate_network): unshare flags, and the seccomp filter's numbers per architecture:
# (AUDIT_ARCH, socket, io_uring_setup, x32 bit or 0).
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425, 0x40000000), "aarch64": (0xC00000B7, 198, 425, 0),
                 "arm64": (0xC00000B7, 198, 425, 0)}
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_EACCES = 13
ALLOWED_SOCKET_FAMILIES = (2, 10)  # AF_INET, AF_INET6: they reach nothing inside the empty network namespace

SYSTEM_READ_PATHS = ("/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/localtime", "/etc/mime.types")
DEVICE_PATHS = ("/dev/null", "/dev/urandom")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is unavailable (old kernel, disabled, seccomp)."""
    nums = _SYSCALLS.get(platform.machine())
    if nums is None or not sys.platform.startswith("linux"):
        return 0
    try:
        r = int(_libc().syscall(nums[0], None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)))
    except (OSError, AttributeError):
        return 0
    return max(r, 0)


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        rights |= 1 << 13  # REFER
    if abi >= 3:
        rights |= _FS_TRUNCATE
    if abi >= 5:
        rights |= _FS_IOCTL_DEV
    return rights


def confine(read_paths: Sequence[str], write_paths: Sequence[str], *, devices: Sequence[str] = DEVICE_PATHS) -> int:
    """Landlock the calling process (one thread: call it before anything starts threads).

    Returns the ABI used; raises ``OSError`` if the kernel refuses. Paths that do not exist are skipped."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available")
    nums = _SYSCALLS[platform.machine()]
    libc = _libc()
    fs = _fs_rights(abi)
    attr = _RulesetAttr(handled_access_fs=fs, handled_access_net=_NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
                        scoped=_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = int(libc.syscall(nums[0], ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        rules = [(p, _READ_RIGHTS) for p in read_paths] + [(p, fs) for p in write_paths]
        rules += [(p, _FS_READ_FILE | _FS_WRITE_FILE) for p in devices]
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    rights &= _FILE_RIGHTS
                rule = _PathBeneathAttr(allowed_access=rights & fs, parent_fd=fd)
                if libc.syscall(nums[1], ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule),
                                ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(nums[2], ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _socket_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The seccomp program (classic BPF over ``struct seccomp_data``): deny ``socket()`` of every family but
    AF_INET/AF_INET6, ``io_uring_setup``, any foreign syscall ABI; allow the rest. Deny = EACCES."""
    arch, nr_socket, nr_uring, x32 = _SECCOMP_ARCH[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    # (code, label-or-offset jt, jf, k) with jumps to the labels "allow"/"deny" resolved below.
    body: list[tuple[int, object, object, int]] = [(ld, 0, 0, 4), (jeq, 0, "deny", arch), (ld, 0, 0, 0)]
    if x32:
        body.append((jge, "deny", 0, x32))
    body += [(jeq, "deny", 0, nr_uring), (jeq, 0, "allow", nr_socket), (ld, 0, 0, 16)]  # args[0]: the family
    fams = ALLOWED_SOCKET_FAMILIES
    body += [(jeq, "allow", 0 if i < len(fams) - 1 else "deny", fam) for i, fam in enumerate(fams)]
    labels = {"allow": len(body), "deny": len(body) + 1}
    prog = []
    for i, (code, jt, jf, k) in enumerate(body):
        def off(j: object, i: int = i) -> int:
            return labels[j] - i - 1 if isinstance(j, str) else int(j)  # type: ignore[call-overload]

        prog.append((code, off(jt), off(jf), k))
    return prog + [(ret, 0, 0, _SECCOMP_RET_ALLOW), (ret, 0, 0, _SECCOMP_RET_ERRNO | _EACCES)]


def isolate_network() -> None:
    """Cut the calling process (and everything it starts) off the network: a new, empty network namespace,
    then a seccomp filter on socket families (module docstring). Raises ``OSError`` naming the step that
    failed; call it in the child before anything starts threads, before :func:`confine`."""
    machine = platform.machine()
    if not sys.platform.startswith("linux") or machine not in _SECCOMP_ARCH:
        raise OSError(f"network isolation needs Linux on x86_64 or arm64 (this is {sys.platform} {machine})")
    libc = _libc()
    tried = [_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET] if os.geteuid() == 0 else [_CLONE_NEWUSER | _CLONE_NEWNET]
    errors = []
    for flags in tried:
        if libc.unshare(ctypes.c_int(flags)) == 0:
            break
        errors.append(os.strerror(ctypes.get_errno()))
    else:
        raise OSError(f"unshare(CLONE_NEWNET) failed ({'; '.join(errors)}): no private network namespace (a "
                      "container needs CAP_SYS_ADMIN or user namespaces: kernel.unprivileged_userns_clone / "
                      "user.max_user_namespaces)")
    prog = _socket_filter(machine)
    arr = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed: no socket-family filter")


_ISOLATION_PROBE = "\n".join([
    "import sys", "sys.path[:0] = [sys.argv[1]]", "from dpops.sandbox import isolate_network", "isolate_network()",
    "import socket", "try:", "    socket.socket(socket.AF_UNIX)", "except OSError:", "    sys.exit(0)",
    "sys.exit(3)", ""])


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> str | None:
    """None when :func:`isolate_network` works on this machine (tried in a throwaway child), else why not.

    Callers refuse to run untrusted suites without it, before anything is reserved (``dpops.gx_project``)."""
    try:
        proc = subprocess.run(  # noqa: S603 - this interpreter and dpops' own code, fixed argv
            [sys.executable, "-I", "-c", _ISOLATION_PROBE, str(Path(_dpops_dir()).parent)], capture_output=True,
            timeout=60, env=child_env("/tmp"), close_fds=True, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the isolation probe could not run ({type(exc).__name__})"
    if proc.returncode == 0:
        return None
    last = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    return last[-1][:300] if last else f"the isolation probe exited {proc.returncode}"


def _readable_by_others(path: str) -> bool:
    """Every directory on the way to ``path`` is searchable by others and ``path`` itself readable."""
    p = Path(os.path.realpath(path))
    try:
        for parent in reversed(p.parents):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        return bool(os.stat(p).st_mode & stat.S_IROTH)
    except OSError:
        return False


def _dpops_dir() -> str:
    import dpops

    return str(Path(dpops.__file__).resolve().parent)


def python_read_paths() -> list[str]:
    """What the child's interpreter must read: the installation prefixes (stdlib, site-packages) and the
    interpreter's own directory. ``PYTHONPATH`` entries are not included: only the ``dpops`` package is."""
    import site

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages()}
    return sorted(p for p in paths if p and os.path.isdir(p))


@dataclass(frozen=True)
class Confinement:
    """How a child will be confined: the uid it runs as (None: unchanged) and the Landlock ABI (0: none)."""

    uid: int | None
    landlock: int

    def describe(self) -> str:
        """For logs and the report: which uid and which Landlock ABI."""
        who = f"uid {self.uid}" if self.uid is not None else f"uid {os.geteuid()}"
        return f"{who}, Landlock ABI {self.landlock}" if self.landlock else f"{who}, no Landlock"


def planned_confinement(*, drop_uid: bool = True) -> Confinement:
    """What :func:`run_confined` will apply on this machine."""
    uid = None
    if drop_uid and os.geteuid() == 0:
        needed = [os.path.realpath(sys.executable), *python_read_paths(), _dpops_dir()]
        if all(_readable_by_others(p) for p in needed):
            uid = UNPRIVILEGED_UID
    return Confinement(uid=uid, landlock=landlock_abi())


_BOOT = (
    "import json, sys\n"
    "cfg = json.loads(sys.argv[1])\n"
    "sys.path[:0] = cfg['path']\n"
    "from dpops.sandbox import child_main\n"
    "child_main(cfg)\n"
)


def child_env(scratch: str) -> dict[str, str]:
    """The child's whole environment: nothing inherited, so no secret or key reference can leak in."""
    return {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "GX_ANALYTICS_ENABLED": "false", "SCARF_ANALYTICS": "false", "DO_NOT_TRACK": "true",
            "PYTHONDONTWRITEBYTECODE": "1", "MPLCONFIGDIR": scratch, "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


_RESULT_FD: int | None = None


def child_main(cfg: dict[str, object]) -> None:
    """Inside the child: confine, move stdout aside for the answer, run the job module."""
    global _RESULT_FD
    read = [str(p) for p in cfg["read"]]  # type: ignore[attr-defined]
    write = [str(p) for p in cfg["write"]]  # type: ignore[attr-defined]
    if cfg.get("network_isolation", True):
        try:
            isolate_network()
        except OSError as exc:
            sys.stderr.write(f"dpops sandbox: network isolation could not be applied: {exc}\n")
            sys.exit(97)
    if cfg.get("landlock"):
        try:
            confine(read, write)
        except OSError:
            sys.stderr.write("dpops sandbox: Landlock could not be applied\n")
            sys.exit(97)
    os.umask(0o077)
    _RESULT_FD = os.dup(1)
    os.dup2(2, 1)  # library prints go to stderr, never into the answer
    import runpy

    runpy.run_module(str(cfg["module"]), run_name="__main__", alter_sys=True)


def write_result(doc: object) -> None:
    """The child's answer (one JSON document)."""
    fd = _RESULT_FD if _RESULT_FD is not None else 1
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(doc, out)


@dataclass(frozen=True)
class ChildResult:
    """What the child returned: exit status, its answer (stdout), its own output (stderr)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    confinement: Confinement

    def show_stderr_if_debug(self) -> None:
        """The child's own output, for whoever runs the process with ``DPOPS_DEBUG=1`` (it holds no secret:
        the child could read none)."""
        if os.environ.get(DEBUG_ENV):
            sys.stderr.write(self.stderr.decode("utf-8", "replace")[-8000:])


def run_confined(module: str, payload: bytes, scratch: str | os.PathLike[str], *,
                 extra_path: Sequence[str] = (), timeout: float = 600.0, drop_uid: bool = True,
                 require_landlock: bool = True) -> ChildResult:
    """Run ``python -m module`` confined as described above, ``payload`` on its stdin.

    ``extra_path`` directories are put on the child's ``sys.path`` and made readable (tests use it
    for probe modules). ``scratch`` is a fresh directory the child may write (chowned to the child's uid here); the
    caller puts the child's input files there and reads its output files from there. A child still
    running after ``timeout`` seconds is killed (its own process group)."""
    plan = planned_confinement(drop_uid=drop_uid)
    if require_landlock and not plan.landlock:
        raise InternalError("the Landlock sandbox is not available on this kernel")
    scratch = str(Path(scratch).resolve())
    if plan.uid is not None:
        for dirpath, dirnames, filenames in os.walk(scratch):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.lchown(name, plan.uid, plan.uid)
    cfg = {"path": [str(Path(_dpops_dir()).parent), *extra_path], "module": module, "landlock": bool(plan.landlock),
           "read": [*python_read_paths(), _dpops_dir(), *SYSTEM_READ_PATHS, *extra_path], "write": [scratch]}
    kwargs: dict[str, object] = {}
    if plan.uid is not None:
        kwargs = {"user": plan.uid, "group": plan.uid, "extra_groups": []}
    proc = subprocess.Popen(  # noqa: S603 - a fixed argv: this interpreter and dpops' own bootstrap
        [sys.executable, "-I", "-c", _BOOT, json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, cwd=scratch, env=child_env(scratch), close_fds=True, start_new_session=True,
        umask=0o077, **kwargs)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise InternalError(f"the sandboxed {module} did not finish within {timeout:.0f} s; it was stopped") from None
    return ChildResult(returncode=proc.returncode, stdout=out, stderr=err, confinement=plan)
