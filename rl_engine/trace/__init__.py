"""The trace gate: kernel launches counted by family from profiler traces, checked against a plan."""
