"""The Modal app (`modal deploy modal_app/app.py`): the app, its `BUNDLE_MODAL_*` settings, the
compile-cache layout its volumes hold, and the deploy smoke test."""
