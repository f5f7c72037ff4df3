"""What the layer-streamed runner asks of the operating system: glibc's allocator settings, the process's
resident memory from /proc, and a thread that reads the next stage's weights into the page cache."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path


class MallocTuning:
    """glibc knobs for a process that frees a whole layer at a time.

    The mmap threshold is fixed at 32 MiB (glibc's own ceiling) and the trim threshold at 256 MiB. Below
    32 MiB sit the forward's per-call temporaries (float64 copies of activations, QDQ scratch, expert
    rows), which then reuse heap pages instead of faulting in fresh zeroed ones on every call: measured on
    the 3,952-token panel of the > RAM benchmark, a 256 KiB threshold spent 2 min 50 s of system time in a
    3 min 27 s run, 32 MiB 20 s in 1 min 46 s. The routed experts, the bulk of a layer, live in the
    runner's OutputBuffers and are reused explicitly; what else the heap keeps after a stage, malloc_trim
    returns. Peak RSS stays inside the 1.5 x (layer + activations) bound on that run (1.79 of 2.13 GB)."""

    M_TRIM_THRESHOLD = -1
    M_MMAP_THRESHOLD = -3

    def __init__(self):
        import ctypes
        import ctypes.util

        try:
            self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 32 << 20)
            self.libc.mallopt(self.M_TRIM_THRESHOLD, 256 << 20)
        except (OSError, AttributeError):  # not glibc: nothing to tune
            self.libc = None

    def trim(self) -> None:
        if self.libc is not None:
            self.libc.malloc_trim(0)


def _proc_kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def status_kib(key: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM, ...); 0 when absent."""
    return _proc_kib("/proc/self/status", key)


def meminfo_kib(key: str) -> int:
    """A kB field of /proc/meminfo (MemAvailable, ...); 0 when absent."""
    return _proc_kib("/proc/meminfo", key)


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0; elsewhere the peak keeps counting from the start)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


class Readahead:
    """While a stage computes, a thread reads the next stage's stored bytes once into the page cache, so
    the disk time hides behind the compute (measured: a cold 256 MB shard read 0.11-0.45 s, warm 0.02 s).
    It holds one small buffer (RSS unchanged; the page cache is the kernel's). Advisory only: the load
    itself reads, checks and reports every byte, so a failure here changes nothing but the timing."""

    def __init__(self):
        self._thread: threading.Thread | None = None

    def start(self, ranges: list[tuple[Path, int, int]]) -> None:
        """Read each (file, begin, end) byte range in the background; waits for the previous call first."""
        self.wait()
        self._thread = threading.Thread(target=self._read, args=(ranges,), name="ds41-readahead", daemon=True)
        self._thread.start()

    @staticmethod
    def _read(ranges: list[tuple[Path, int, int]]) -> None:
        buf = memoryview(bytearray(1 << 22))
        try:
            for path, begin, end in ranges:
                with open(path, "rb", buffering=0) as f:
                    f.seek(begin)
                    while begin < end and (n := f.readinto(buf[:min(end - begin, len(buf))])):
                        begin += n
        except OSError:
            return

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
