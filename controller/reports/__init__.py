"""The files people read after a run: the provisioning report and the certification report."""
