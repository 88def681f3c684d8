"""Instance selection: shared instance set, load ledger, health, policies and admission (no Sanic here)."""
