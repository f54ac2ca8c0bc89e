"""Request identity: one generation's shared output, de-duplication, replay and resume,
within one process (registry) and across replicas (the Redis store and log)."""
