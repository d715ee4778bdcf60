"""The trainer (train/), the rollout engine (rollout/) and the launcher that starts their ranks."""
