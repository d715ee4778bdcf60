"""The operator plan, routing of each module to its R or P implementation, and readbacks."""
