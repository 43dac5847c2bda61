"""Kernel metrics of the node and its training ranks through eBPF (bcc), aggregated in kernel maps.

Only ``loader`` imports bcc. Use ``EbpfCollector`` (the Collector protocol); ``render_all()``
gives the generated C for ``--print-bpf``; ``METRICS`` lists every exported family.
"""

from .collector import EbpfCollector, render_all
from .hist import Log2Hist, log2_buckets, log2_quantile
from .metrics import METRICS, KernelSnapshot
from .rankstats import RankKernelStats

__all__ = ["EbpfCollector", "RankKernelStats", "render_all", "METRICS", "KernelSnapshot", "Log2Hist",
           "log2_buckets", "log2_quantile"]
