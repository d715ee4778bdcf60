"""Airflow 3 support for running rlk commands as Ray jobs.

``hooks.RayJobHook`` talks to the Ray Job Submission API, ``operators.RayJobOperator`` submits a job
and defers, ``triggers.RayJobTrigger`` follows the job from the triggerer and streams its log, and
``entrypoint.build_rlk_command`` builds the job's shell command from validated values.
"""
