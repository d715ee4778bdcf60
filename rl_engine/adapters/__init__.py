"""Adapters that put the real engines behind rl_engine's engine interface: vLLM (rollout) and
Megatron-core (trainer), each routed per module to torch.ops.rl_engine by the run's plan."""
