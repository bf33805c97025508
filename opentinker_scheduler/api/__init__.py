"""The scheduler's transports: gRPC servicers (SchedulerService, NodeService, AdminService) as
thin adapters over :mod:`..state`, and the HTTP side port."""
