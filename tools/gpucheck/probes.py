"""A rank's peak memory over a block, as gpu-check measures it: on GPUs the allocator's
peaks restarted, on CPU the resident set's growth (RssGrowth). The worker and the MFU case
both measure this way; neither imports the other for it.
"""

from __future__ import annotations

import gc


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def reset_peaks(gpu: bool) -> None:
    """Restart the peaks a block is measured from (CUDA's allocator, or VmHWM on CPU)."""
    gc.collect()
    if gpu:
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from the current RSS


class RssGrowth:
    """A CPU rank's memory growth over a block: the larger of the kernel's exact peak
    resident set (VmHWM, restarted on entry) and the peak anonymous memory (RssAnon,
    sampled every `interval_s`), each above its own value on entry.

    The resident set alone is not enough on a loaded host: the kernel drops the file-backed
    pages of torch's shared libraries (hundreds of MiB) under memory pressure, so a tiny
    model's run can end with its resident set below where it started (a CI run read
    -87 MB). Anonymous pages (the model, optimizer, activations, gloo's buffers) are never
    dropped without swap, so their sampled peak is the growth the planner predicts."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.bytes = 0

    def __enter__(self) -> RssGrowth:
        import threading

        reset_peaks(False)
        self._rss0, self._anon0 = _status("VmRSS:"), _status("RssAnon:")
        self._anon_peak = self._anon0
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self._anon_peak = max(self._anon_peak, _status("RssAnon:"))

        self._thread = threading.Thread(target=sample, name="rss-growth", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        anon = max(self._anon_peak, _status("RssAnon:")) - self._anon0
        self.bytes = max(_status("VmHWM:") - self._rss0, anon)
