"""One post-training step (or several): rollout, log-prob transfer, training, weight sync, evidence."""
