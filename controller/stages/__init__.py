"""The stages one box goes through: probe, estimate, plan, render, run, verify (ARCHITECTURE.md)."""
