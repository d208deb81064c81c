"""The one typed config tree (schema.py), how it is read from files, flags and env (load.py), and every rule that
spans sections (checks.py)."""
