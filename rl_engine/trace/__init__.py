"""The trace check: kernel launches counted by family from profiler traces, checked against a plan."""
