"""Resident memory of this process: each stage's own peak, what stays resident after it, and the run's peak.

On Linux the numbers come from /proc/self/status (`VmHWM`, `VmRSS`): getrusage's ru_maxrss survives fork and
exec, so a run started from a large process (a test runner, a notebook) would report the parent's size. A
stage starts with `new_stage()`, which folds the high-water mark into the run's peak and resets it (writing
5 to /proc/self/clear_refs), so `peak_mb()` is that stage's own peak. Where the reset is unavailable
(another OS, a locked-down /proc) stage peaks are cumulative, as the run's peak always is.
"""
from __future__ import annotations

import resource
import sys

_run_peak_mb = 0.0


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_mb() -> float:
    """Peak resident set size since the current stage began (since the process began where it cannot be reset)."""
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def resident_mb() -> float:
    """Resident set size now."""
    rss = _status_mb("VmRSS")
    if rss is None:
        import psutil

        rss = psutil.Process().memory_info().rss / 2**20
    return rss


def stage_marks() -> dict[str, float]:
    """What a stage records as it ends: its own peak and what stays resident (MB, one decimal)."""
    return {"peak_rss_mb": round(peak_mb(), 1), "rss_mb": round(resident_mb(), 1)}


def run_peak_mb() -> float:
    """Peak resident set size over every stage so far."""
    return max(_run_peak_mb, peak_mb())


def new_stage() -> None:
    """Start a stage: fold the high-water mark into the run's peak and reset it."""
    global _run_peak_mb
    _run_peak_mb = run_peak_mb()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
