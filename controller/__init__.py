"""Provision Tesla V100 boxes that serve GGUF models with llama.cpp: probe, plan, render, run, verify."""

from pathlib import Path

__version__ = "0.1.0"
# The collection v100box.llm (roles, playbooks, plugins) beside this package: a clone's, or the one a wheel installed
# into site-packages next to controller/. Every module that reads a file of the collection starts from here.
COLLECTION = Path(__file__).resolve().parent.parent / "ansible_collections" / "v100box" / "llm"
