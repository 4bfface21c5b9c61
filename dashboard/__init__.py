"""The admin dashboard: server-rendered pages under ``/admin`` over tenants' queries and the engine's stats.

``dashboard_router(sources)`` returns the Litestar router and ``template_config()`` the Jinja2 template
configuration; the application wires both in. Nothing here imports ``api``.
"""

from dashboard.router import dashboard_router, template_config
from dashboard.sources import DashboardSources

__all__ = ["DashboardSources", "dashboard_router", "template_config"]
