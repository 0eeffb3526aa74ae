"""The web playground's static files (served by :mod:`api.routers.playground`)."""
