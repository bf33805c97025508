"""Hosting an environment in your own process: :class:`~opentinker_client.hosting.server.EnvironmentServer`
serves ``EnvironmentService`` (:mod:`.service`) behind a bearer token (:mod:`.auth`)."""
