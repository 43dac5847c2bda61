"""Detection: stragglers (service.py, straggler.py, causes.py, evidence.py), hangs (hang.py, activity.py,
stacks.py), loss divergence (divergence.py) and peer-connection failures (peerdiag.py)."""

from trainguard.agent.detect.config import DetectionConfigError, StragglerConfig
from trainguard.agent.detect.service import METRICS, StragglerService, install

__all__ = ["METRICS", "DetectionConfigError", "StragglerConfig", "StragglerService", "install"]
