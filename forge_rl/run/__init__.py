"""A run: its lifecycle, the train loop, launching its meshes, its directory, preflight checks, export, recipes."""
