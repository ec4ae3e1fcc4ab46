#!/usr/bin/env python3
"""syscalls.py: the x86-64 numbers of the system calls that moed.service's
SystemCallFilter= lines allow, one a line, for seccomp-exec --allow.

    syscalls.py [UNISTD_64_H] > allow.txt

Reads the groups from `systemd-analyze syscall-filter` (so they are this
systemd's) and the numbers from the kernel headers. The allow list is
@system-service with @privileged taken out, as systemd applies
"SystemCallFilter=@system-service" then "SystemCallFilter=~@privileged".
"""
import re
import subprocess
import sys

ALLOW, DENY = ["@system-service"], ["@privileged"]


def groups():
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"],
                         capture_output=True, text=True, check=True).stdout
    g, cur = {}, None
    for line in out.splitlines():
        if line.startswith("@"):
            cur = g.setdefault(line.strip(), [])
        elif cur is not None and line.strip() and not line.strip().startswith("#"):
            cur.append(line.strip())
    return g


def expand(names, g, seen=None):
    seen = set() if seen is None else seen
    out = set()
    for n in names:
        if n.startswith("@"):
            if n not in seen:
                seen.add(n)
                out |= expand(g.get(n, []), g, seen)
        else:
            out.add(n)
    return out


def main():
    hdr = sys.argv[1] if len(sys.argv) > 1 else "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"
    nums = {m.group(1): int(m.group(2))
            for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", open(hdr).read())}
    g = groups()
    names = expand(ALLOW, g) - expand(DENY, g)
    for nr in sorted(nums[n] for n in names if n in nums):
        print(nr)


main()
