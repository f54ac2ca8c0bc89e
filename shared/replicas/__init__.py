"""Request identity across replicas: the shared store and log, liveness, takeover of a
generation whose replica died, and the local stand-in when no store is configured."""
