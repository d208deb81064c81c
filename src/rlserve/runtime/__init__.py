"""How the server drives an engine: one declared face (face.py) and its in-thread, own-process and data-parallel
forms."""
