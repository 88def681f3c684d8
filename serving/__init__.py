"""What happens to one inference request, from a validated Job to bytes for the client (no Sanic here)."""
