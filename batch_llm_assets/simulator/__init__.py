"""OpenAI-compatible provider simulator: exact limits, OpenAI's 429s, latency and faults."""

from .process import SimulatorProcess
from .server import SimConfig, Simulator, SimulatorThread, start_site

__all__ = ["SimConfig", "Simulator", "SimulatorProcess", "SimulatorThread", "start_site"]
