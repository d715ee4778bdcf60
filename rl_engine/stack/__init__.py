"""The embedded stack: a local Ray head and a project-local Airflow home under the state folder.

``ray_head`` starts and stops a Ray head that shares the machine politely (free ports, its own
short temp folder, stopped by the pids it started). ``airflow_home`` prepares an Airflow home on
SQLite whose DAGs and plugins are this repository's. ``demo`` runs the matrix DAG end to end on
them (``rlk demo``); ``services`` keeps them running in the background (``rlk up`` / ``rlk down``).
"""
