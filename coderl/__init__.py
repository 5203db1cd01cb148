"""coderl: reinforcement-learning post-training for LLM coding agents."""

__version__ = "0.1.0"
