"""The one typed config tree (schema), how it is read from files, flags and env (load), and every rule that spans sections (checks)."""
