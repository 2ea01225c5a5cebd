"""A GPU check anyone can run in one command (issue 20, item 6): ``python -m lab.gpu_check``.

On a Linux machine with an NVIDIA GPU, nvcc and CMake it builds the CPU test engine's llama.cpp commit with CUDA
for that card (``build``), records what the server allocates for the recorded-truth cases (``cases``), asks
nvidia-smi every query the product makes and reads the answers with the product's parsers (``smi``), traces the
CUDA server and holds what it did against the llama_service unit (``trace``, ``unit``), and packs it all into one
folder and a .tar.xz (``run``). ``--cpu`` runs the same pipeline on the CPU engine, which is how CI tests it.
Nothing here is imported at package import: an offline GPU machine first makes its Python packages importable.
"""
