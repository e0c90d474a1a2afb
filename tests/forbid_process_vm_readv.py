"""``python tests/forbid_process_vm_readv.py COMMAND ...``: run COMMAND, and everything it starts,
with process_vm_readv and process_vm_writev failing with EPERM, as Docker's default seccomp
profile (and Kubernetes' RuntimeDefault) makes them fail for processes without CAP_SYS_PTRACE.

It installs that seccomp filter on itself, then execs COMMAND, which inherits it. x86_64 only
(the syscall numbers are that architecture's); PR_SET_NO_NEW_PRIVS lets an unprivileged process
install the filter.
"""

import ctypes
import os
import platform
import struct
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
AUDIT_ARCH_X86_64 = 0xC000003E
PROCESS_VM_READV, PROCESS_VM_WRITEV = 310, 311
LOAD_WORD, JUMP_IF_EQUAL, RETURN = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
ALLOW, ERRNO_EPERM = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM


def _instruction(code: int, jump_true: int, jump_false: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jump_true, jump_false, k)  # struct sock_filter


PROGRAM = b"".join([
    _instruction(LOAD_WORD, 0, 0, 4),  # seccomp_data.arch
    _instruction(JUMP_IF_EQUAL, 0, 4, AUDIT_ARCH_X86_64),  # another architecture: allow
    _instruction(LOAD_WORD, 0, 0, 0),  # seccomp_data.nr
    _instruction(JUMP_IF_EQUAL, 2, 0, PROCESS_VM_READV),
    _instruction(JUMP_IF_EQUAL, 1, 0, PROCESS_VM_WRITEV),
    _instruction(RETURN, 0, 0, ALLOW),
    _instruction(RETURN, 0, 0, ERRNO_EPERM),
])


class _FilterProgram(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("length", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def forbid() -> None:
    if platform.machine() != "x86_64":
        raise OSError(f"forbid_process_vm_readv.py knows x86_64's syscall numbers only, not {platform.machine()}'s")
    libc = ctypes.CDLL(None, use_errno=True)
    code = ctypes.create_string_buffer(PROGRAM)
    program = _FilterProgram(len(PROGRAM) // 8, ctypes.addressof(code))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "installing the seccomp filter failed")


if __name__ == "__main__":
    forbid()
    os.execvp(sys.argv[1], sys.argv[1:])
