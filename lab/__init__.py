"""A local lab: a CPU engine built from source, tiny generated models, a download server, a systemd box.

The demo (``controller demo``) and the test suite use it from a clone; it is not part of the installed package.
"""
