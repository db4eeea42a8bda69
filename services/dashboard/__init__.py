"""The dashboard: a web UI the master serves beside its REST API (``/dashboard/``).

Plain JavaScript modules and Apache ECharts (``static/vendor``, committed with its licence and
pinned by checksum: ``static/vendor/echarts.json``), no build step. ``views`` builds each page's
data from the master's service layer; ``routes`` adds the pages, their JSON and a server-sent event
stream (fed by the master's wake-up channels) to the master's FastAPI app. Same tokens and owner
isolation as the REST API: the page keeps the token in the browser's session storage and sends it
as a bearer token.
"""
