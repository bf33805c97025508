"""Who may call what: API keys and roles, the auth interceptor, streams that end with their key,
the audit log, and TLS for the scheduler's ports."""
