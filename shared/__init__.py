"""The serving core, shared by the HTTP server, the Modal app and the Cog runner: its layers, top
floor down, are listed and enforced in tests/test_layout.py."""
