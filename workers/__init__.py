"""Sanic worker processes from the main process's side: the supervisor that restarts dead or stuck workers, and the heartbeat each worker writes."""
