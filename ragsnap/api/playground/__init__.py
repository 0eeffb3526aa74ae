"""The web playground's static files (served by :mod:`ragsnap.api.routers.playground`)."""
