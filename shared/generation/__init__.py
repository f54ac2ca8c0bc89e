"""One generation's life inside this process: its output and replay buffer, the registry that
de-duplicates ids, and the reader protocol every door hands out."""
