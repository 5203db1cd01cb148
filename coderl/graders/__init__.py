"""Learned graders: a rubric LLM judge, a Bradley-Terry reward model, their composition with the
verifiable reward (``reward.learned_requires_tests``) and gameability probes. See docs/graders.md.
"""
