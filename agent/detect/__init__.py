"""Detectors that run in the agent's main loop (stragglers: service.py, straggler.py, causes.py)."""

from trainguard.agent.detect.config import DetectionConfigError, StragglerConfig
from trainguard.agent.detect.service import METRICS, StragglerService, install

__all__ = ["METRICS", "DetectionConfigError", "StragglerConfig", "StragglerService", "install"]
