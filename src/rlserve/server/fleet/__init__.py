"""Routes a deployment's router uses on its workers, and the guard a deployment puts in front of them."""
