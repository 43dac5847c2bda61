"""Online LR and batch-size retuning on the leader agent.

``install(agent, ControllerConfig(...))`` adds the controller's tick hook and metric source to a
started agent. Strategies: optuna (optuna_strategy.py), rl (bandit.py), goodput (goodput.py);
the safety rules and the window mechanics live in controller.py, a job's windows and state in
window.py.
"""

from trainguard.agent.controller.config import ControllerConfig
from trainguard.agent.controller.controller import METRICS, Controller, install, make_strategy
from trainguard.agent.controller.strategy import Proposal, Setting, Space, Strategy, WindowResult
from trainguard.agent.controller.window import split_batch

__all__ = ["METRICS", "Controller", "ControllerConfig", "Proposal", "Setting", "Space", "Strategy",
           "WindowResult", "install", "make_strategy", "split_batch"]
