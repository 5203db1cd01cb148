"""Real-time RL: learn from production interactions, near on-policy, behind an eval gate.

``serve`` records exact tokens and behaviour logprobs of every completion; outcome events arrive
later (feedback endpoint, JSONL import) into a SQL store (SQLite WAL or PostgreSQL); a versioned
reward spec turns them into per-episode rewards; a cycle claims a batch, trains near on-policy
with single-sample baselines, evaluates the candidate against the champion and promotes it only
through the gate, with behaviour monitors whose alarms block promotion.
"""
