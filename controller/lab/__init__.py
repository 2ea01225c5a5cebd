"""A local lab: a CPU engine built from source, tiny generated models, a download server, a systemd box.

The demo (``controller demo``) and the test suite both use it, so it lives in the package.
"""
