"""The package map that pyproject.toml cannot state: the repository's agent/, trainer/ and tui/
folders are installed as trainguard.agent, trainguard.trainer and trainguard.tui (one import name,
never top-level names that a user's own agent.py or trainer.py would shadow), each file at one path."""

from setuptools import find_packages, setup

MAPPED = {"trainguard.agent": "agent", "trainguard.trainer": "trainer", "trainguard.tui": "tui"}

packages = find_packages(include=["trainguard", "trainguard.*"])
for name, folder in MAPPED.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir=MAPPED)
