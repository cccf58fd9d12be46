"""This process's resident memory, from /proc/self/status, for the helpers that measure a peak.

VmHWM is the high-water mark of this process's own address space. `resource.getrusage(...).ru_maxrss`
is not: Linux carries the parent's peak into a child started by vfork and exec (as `subprocess` starts
one), so a helper started by a pytest worker that once held 7 GiB reported 7 GiB whatever it used.
"""


def memory(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)
