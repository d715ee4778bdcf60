"""vLLM as the rollout engine: a vLLM plugin that routes each module of the rollout side to
torch.ops.rl_engine (R) or leaves vLLM's own computation in place (P), and the rollout rank that
drives a resident vLLM engine behind rl_engine's engine interface.

Nothing here imports vLLM at module level except the modules vLLM itself loads (plugin, layers,
attention, binding, worker), so `rlk` can name the engine without importing it.
"""
