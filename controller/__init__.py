"""Provision Tesla V100 boxes that serve GGUF models with llama.cpp: probe, plan, render, run, verify."""

__version__ = "0.1.0"
