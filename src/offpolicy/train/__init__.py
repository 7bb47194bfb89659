"""GRPO/PPO training with a real rollout engine: config, warm start, loop, checkpoints, logging."""
