"""Airflow 3 plugin: the rl-engine matrix reports and their nightly history in the Airflow UI.

``fastapi_apps`` mounts the pages (``rlk_ui.app``) on the API server under ``/rlk``;
``external_views`` adds a "Parity matrix" entry to the navigation that shows them inside the UI
(same origin, so Airflow's session cookie authenticates them). The class is defined here and
nowhere else: Airflow imports every ``.py`` file of the plugins folder on its own and registers
each AirflowPlugin subclass it finds, so a second reference would register the plugin twice.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from rlk_ui.app import create_app

MOUNT = "/rlk"


class RlkMatrixReportsPlugin(AirflowPlugin):
    name = "rlk_ui"
    fastapi_apps = [{"app": create_app(), "url_prefix": MOUNT, "name": "rl-engine matrix reports"}]
    # href is relative (no leading slash): the UI resolves it against its base URL, so a deployment
    # under a path prefix works; url_route shows it embedded at <ui>/plugin/rlk-matrix; without a
    # category it is a top-level entry of the navigation.
    external_views = [{"name": "Parity matrix", "href": MOUNT.lstrip("/") + "/", "url_route": "rlk-matrix",
                       "destination": "nav"}]
